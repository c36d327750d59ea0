"""The stored state of a DCI index (`DCITree`): the points, their projections, the level lists, the parent
tree, the clusters' sorted runs in one slab and the optional page table, with the small edits every job needs
(growth, slab blocks, member lists, lifting) and what reads the whole state (introspection, `DCITree.check`).

The jobs that change it live in their own modules: bulk construction in `icecache.indexes.dci_build`, insertion
in `icecache.indexes.dci_update`; queries (`icecache.indexes.dci_search`) only read it. `icecache.indexes.dci.DCIIndex`
is the facade that composes them. Section names refer to ``docs/index.md``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from icecache.core.capacity import grown_capacity
from icecache.core.pages import PageTable
from icecache.indexes import _dci_edit_kernels as edit_kernels
from icecache.indexes import _dci_kernels as kernels
from icecache.indexes.dci_params import DCIParams, Metric


def _schedule_cap(p: float) -> int:
    """ceil(1 / p), robust to rounding (ceil(1/0.2) = 5, ceil(1/0.03) = 34)."""
    return math.ceil(1.0 / p - 1e-9)


class DCITree:
    """The arrays of a multi-level DCI index. Only the DCI modules write them (the build, update and search
    functions, the compiled kernels); everyone else reads them through `icecache.indexes.dci.DCIIndex`.

    Parameters
    ----------
    dim : int
        Vector width d (validated by the facade).
    metric : {"euclidean", "mips"}
        Distance; MIPS lifts the keys (MIPS to L2 transform).
    params : DCIParams
        Algorithm parameters.
    seed : int
        Seed of the random directions (``numpy.random.Generator(PCG64(seed))``).
    table : PageTable or None
        Keep semantic pages of the clusters in this table.
    single_level : bool
        Every point on one level (a flat prioritized DCI).

    Attributes
    ----------
    Per point (row = id, ``capacity`` rows of which ``num_points`` are live; kernel argument names in brackets):

    ====================  =======================  =======================================================
    ``vectors``           ``[cap, d]`` float32     the points [X]
    ``ext``               ``[cap]`` float32        MIPS extra coordinate ``sqrt(max(msq - |x|^2, 0))`` [ext]
    ``proj``              ``[cap, M]`` float32     projections of the (lifted) points on the directions
    ``level_of``          ``[cap]`` int32          level of the point
    ``parent_of``         ``[cap]`` int64          parent node (-1: the virtual root)
    ``parent_dist``       ``[cap]`` float64        key-key distance to the parent (adoption compares it)
    ``num_descendants``   ``[cap]`` int64          points below the node (coverage rule) [sub]
    ====================  =======================  =======================================================

    Per cluster ``c`` = node ``c - 1`` (``c = 0``: the virtual root, whose children are the top level),
    ``[cap + 1]`` int64: ``cluster_start`` [cl_start], ``cluster_size`` [cl_size], ``cluster_cap`` (its block
    of the slab). The slab, ``slab_used`` columns of which are allocated: ``run_key`` ``[M, S]`` float32 (the
    members' projections on direction j, sorted by (key, id) within each cluster block), ``run_id`` ``[M, S]``
    int32 (their ids) and ``vectors_run0`` ``[S, d]`` float32 (the keys again in run-0 order [Xr]).

    Levels: ``level_ids[l][: level_counts[l]]`` are the ids on level l (ascending); ``schedule_counts`` and
    ``schedule_next`` are the state of MD's deterministic level schedule (promotion schedule). ``dirs``
    ``[M, dp]`` float64 are the unit directions (``dp = d + 1`` in MIPS mode); ``msq`` (MIPS) is the squared norm c^2 the
    keys are lifted with; ``num_rekeys`` counts rebuilds after a longer key arrived.
    """

    def __init__(
        self, dim: int, metric: Metric, params: DCIParams, seed: int, table: PageTable | None, single_level: bool
    ) -> None:
        self.dim = dim
        self.metric: Metric = metric
        self.params = params
        self.seed = seed
        self.table = table
        self.single_level = single_level
        self.mips = metric == "mips"
        self.query_mode = 1 if self.mips else 0  # kernel distance mode, query -> point
        self.key_mode = 2 if self.mips else 0  # kernel distance mode, point -> point (parents)
        num_dirs = params.num_directions
        lifted_dim = dim + (1 if self.mips else 0)
        rng = np.random.Generator(np.random.PCG64(seed))
        dirs = rng.standard_normal((num_dirs, lifted_dim))
        dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
        self.dirs = dirs  # [M, dp] float64 unit rows
        self.num_rekeys = 0
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Empty the tree (the directions, and the rekey count, are kept)."""
        num_dirs = self.params.num_directions
        self.num_points = 0
        self.capacity = 0
        self.vectors = np.zeros((0, self.dim), np.float32)
        self.ext = np.zeros(0, np.float32)
        self.proj = np.zeros((0, num_dirs), np.float32)
        self.level_of = np.zeros(0, np.int32)
        self.parent_of = np.zeros(0, np.int64)
        self.parent_dist = np.zeros(0, np.float64)
        self.num_descendants = np.zeros(0, np.int64)
        self.cluster_start = np.zeros(1, np.int64)
        self.cluster_size = np.zeros(1, np.int64)
        self.cluster_cap = np.zeros(1, np.int64)
        self.run_key = np.zeros((num_dirs, 0), np.float32)
        self.run_id = np.zeros((num_dirs, 0), np.int32)
        self.vectors_run0 = np.zeros((0, self.dim), np.float32)
        self.slab_used = 0
        self.msq = 0.0
        self.level_ids: list[np.ndarray] = []  # per level: ids (ascending), growable
        self.level_counts: list[int] = []
        self.schedule_counts = np.zeros(64, np.int64)  # [63] = number of levels
        self.schedule_next = np.zeros(1, np.int64)
        # level 1's keys and lifts, packed in `members(1)` order (`level1_packed`): an insert's brute-force parent
        # search streams them instead of gathering one scattered row per node
        self.level1_vectors = np.zeros((0, self.dim), np.float32)
        self.level1_ext = np.zeros(0, np.float32)
        self.level1_rows = 0

    @property
    def num_levels(self) -> int:
        return len(self.level_counts)

    def grow(self, n: int) -> None:
        """Make room for ``n`` points (capacity doubling)."""
        if n <= self.capacity:
            return
        capacity = grown_capacity(n, self.capacity)

        def grown(old: np.ndarray, fill: float, extra: int = 0) -> np.ndarray:
            new = np.full((capacity + extra,) + old.shape[1:], fill, old.dtype)
            new[: len(old)] = old
            return new

        self.vectors = grown(self.vectors, 0.0)
        self.ext = grown(self.ext, 0.0)
        self.proj = grown(self.proj, 0.0)
        self.level_of = grown(self.level_of, -1)
        self.parent_of = grown(self.parent_of, -1)
        self.parent_dist = grown(self.parent_dist, np.inf)
        self.num_descendants = grown(self.num_descendants, 0)
        self.cluster_start = grown(self.cluster_start, 0, 1)
        self.cluster_size = grown(self.cluster_size, 0, 1)
        self.cluster_cap = grown(self.cluster_cap, 0, 1)
        self.capacity = capacity

    def schedule_args(self) -> tuple[np.ndarray, np.ndarray, float, float, int, int]:
        """MD's schedule state and constants as `md_schedule` takes them: ``(counts, next, p0, p1, cap0, cap1)``."""
        p0, p1 = float(self.params.p0), float(self.params.p1)
        return self.schedule_counts, self.schedule_next, p0, p1, _schedule_cap(p0), _schedule_cap(p1)

    def draw_levels(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``m`` levels of MD's schedule (promotion schedule), and whether each opens a new top level:
        ``(levels int64 [m], new_top bool [m])``. Advances the schedule."""
        levels = np.empty(m, np.int64)
        new_top = np.empty(m, np.bool_)
        edit_kernels.md_schedule(m, *self.schedule_args(), levels, new_top)
        return levels, new_top

    # ------------------------------------------------------------------ slab of sorted runs
    def slab_alloc(self, caps: np.ndarray) -> np.ndarray:
        """Reserve blocks of the given capacities at the end of the run slab; returns their starts. When the
        slab is full and more than half of it is garbage left by relocated clusters, it is compacted first."""
        caps = np.asarray(caps, np.int64)
        need = self.slab_used + int(caps.sum())
        if need > self.run_key.shape[1]:
            live = int(self.cluster_cap[: self.num_points + 1].sum())
            if self.slab_used > 2 * live + 256:
                self.compact()
                need = self.slab_used + int(caps.sum())
        starts = self.slab_used + np.cumsum(caps) - caps
        if need > self.run_key.shape[1]:
            slab_cap = grown_capacity(need, self.run_key.shape[1], 256)
            num_dirs = self.run_key.shape[0]
            run_key = np.zeros((num_dirs, slab_cap), np.float32)
            run_id = np.full((num_dirs, slab_cap), -1, np.int32)
            vectors_run0 = np.zeros((slab_cap, self.dim), np.float32)
            run_key[:, : self.slab_used] = self.run_key[:, : self.slab_used]
            run_id[:, : self.slab_used] = self.run_id[:, : self.slab_used]
            vectors_run0[: self.slab_used] = self.vectors_run0[: self.slab_used]
            self.run_key, self.run_id, self.vectors_run0 = run_key, run_id, vectors_run0
        self.slab_used = need
        return starts

    def compact(self) -> None:
        """Move every cluster block to the front of the slab, in cluster order (drops relocation garbage)."""
        cids = np.flatnonzero(self.cluster_cap[: self.num_points + 1] > 0)
        caps = self.cluster_cap[cids]
        new_starts = np.cumsum(caps) - caps
        sizes = self.cluster_size[cids]
        offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        src = np.repeat(self.cluster_start[cids], sizes) + offsets
        dst = np.repeat(new_starts, sizes) + offsets
        run_key = self.run_key[:, src]
        run_id = self.run_id[:, src]
        vectors_run0 = self.vectors_run0[src]
        self.run_key[:, dst] = run_key
        self.run_id[:, dst] = run_id
        self.vectors_run0[dst] = vectors_run0
        self.cluster_start[cids] = new_starts
        self.slab_used = int(caps.sum())

    def relocate(self, cid: int, cap: int) -> None:
        """Move cluster ``cid`` to a new slab block of capacity ``cap`` (the old block becomes garbage)."""
        old, size = int(self.cluster_start[cid]), int(self.cluster_size[cid])
        new = int(self.slab_alloc(np.array([cap]))[0])
        self.run_key[:, new : new + size] = self.run_key[:, old : old + size]
        self.run_id[:, new : new + size] = self.run_id[:, old : old + size]
        self.vectors_run0[new : new + size] = self.vectors_run0[old : old + size]
        self.cluster_start[cid] = new
        self.cluster_cap[cid] = cap

    def fill_cluster(self, cid: int, members: np.ndarray) -> None:
        """Write ``members`` as the (empty, large enough) cluster ``cid``'s sorted runs."""
        start = int(self.cluster_start[cid])
        end = start + len(members)
        for j in range(self.proj.shape[1]):
            order = np.lexsort((members, self.proj[members, j]))
            self.run_key[j, start:end] = self.proj[members[order], j]
            self.run_id[j, start:end] = members[order]
            if j == 0:
                self.vectors_run0[start:end] = self.vectors[members[order]]
        self.cluster_size[cid] = len(members)

    def cluster_run0(self, cid: int) -> np.ndarray:
        """Ids of cluster ``cid`` in run-0 order, int64."""
        start, size = int(self.cluster_start[cid]), int(self.cluster_size[cid])
        return self.run_id[0, start : start + size].astype(np.int64)

    # ------------------------------------------------------------------ levels
    def add_member(self, level: int, point: int) -> None:
        """Append ``point`` to the id list of ``level`` (opening the level if needed)."""
        while len(self.level_ids) <= level:
            self.level_ids.append(np.zeros(16, np.int64))
            self.level_counts.append(0)
        count = self.level_counts[level]
        if count == len(self.level_ids[level]):
            ids = np.zeros(2 * count, np.int64)
            ids[:count] = self.level_ids[level]
            self.level_ids[level] = ids
        self.level_ids[level][count] = point
        self.level_counts[level] = count + 1

    def members(self, level: int) -> np.ndarray:
        """Ids on ``level`` (ascending), int64."""
        return self.level_ids[level][: self.level_counts[level]]

    def level1_packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids [m], vectors [m, d], ext [m])`` of level 1, contiguous, in `members` order. Level 1 only grows
        between two `lift` calls (which change ``ext``, and empty the copy), so the copy is brought up to date by
        appending the newest members' rows."""
        ids = self.members(1)
        m = len(ids)
        if m > self.level1_rows:
            if m > len(self.level1_vectors):
                cap = grown_capacity(m, len(self.level1_vectors))
                vectors = np.empty((cap, self.dim), np.float32)
                ext = np.empty(cap, np.float32)
                vectors[: self.level1_rows] = self.level1_vectors[: self.level1_rows]
                ext[: self.level1_rows] = self.level1_ext[: self.level1_rows]
                self.level1_vectors, self.level1_ext = vectors, ext
            new = ids[self.level1_rows :]
            self.level1_vectors[self.level1_rows : m] = self.vectors[new]
            self.level1_ext[self.level1_rows : m] = self.ext[new]
            self.level1_rows = m
        return ids, self.level1_vectors[:m], self.level1_ext[:m]

    # ------------------------------------------------------------------ transforms
    def lift(self, ids: np.ndarray) -> None:
        """Recompute ``ext`` and projections of ``ids`` from the stored vectors and ``msq``."""
        self.level1_rows = 0  # the packed copy of level 1 holds the old ``ext``
        x = self.vectors[ids].astype(np.float64)
        projections = x @ self.dirs[:, : self.dim].T
        if self.mips:
            ext = np.sqrt(np.maximum(self.msq - np.einsum("ij,ij->i", x, x), 0.0))
            self.ext[ids] = ext
            projections += ext[:, None] * self.dirs[None, :, self.dim]
        self.proj[ids] = projections.astype(np.float32)

    def lift_one(self, point: int) -> None:
        """`lift` of one id, compiled (a decode step's insert lifts one point per (layer, KV head))."""
        lift_point(point, self.vectors, self.dirs, self.dim, float(self.msq), self.mips, self.ext, self.proj)

    def query_proj(self, Q: np.ndarray) -> np.ndarray:
        """Query projections ``[g, M]`` float64. MIPS: of ``c q / |q|`` with ``c = sqrt(msq)`` (a zero query
        projects to 0). MD projects ``q / |q|`` (norm 1) against keys of norm c, which leaves the nearest
        neighbour unchanged but makes the prioritized walk's order unrelated to ``<q, k>`` (docs/index.md, MIPS
        to L2 transform); at norm c the walk is a true L2 walk towards ``[c q / |q|, 0]`` in the lifted space."""
        return kernels.query_projections(np.ascontiguousarray(Q, np.float32), self.dirs, math.sqrt(self.msq), self.mips)

    def point_distance(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Point-to-point distance used for parents, elementwise over id arrays ``a``, ``b`` (float64):
        Euclidean distance, or the MIPS key-key distance (clamped >= 0)."""
        xa = self.vectors[a].astype(np.float64)
        xb = self.vectors[b].astype(np.float64)
        if self.mips:
            dist = self.msq - (xa * xb).sum(-1) - self.ext[a].astype(np.float64) * self.ext[b].astype(np.float64)
            return np.maximum(dist, 0.0)
        return np.sqrt(((xa - xb) ** 2).sum(-1))

    # ------------------------------------------------------------------ introspection
    def cluster(self, node: int, run: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Members of ``node``'s cluster (-1 = root) in the order of simple index ``run``:
        ``(ids int64 [c], projections float32 [c])``."""
        cid = node + 1
        start, size = int(self.cluster_start[cid]), int(self.cluster_size[cid])
        return self.run_id[run, start : start + size].astype(np.int64), self.run_key[run, start : start + size].copy()

    def index_bytes(self) -> int:
        """Bytes of the index structures (see `icecache.indexes.dci.DCIIndex.index_bytes`)."""
        n = self.num_points
        num_dirs = self.params.num_directions
        total = self.dirs.nbytes + n * num_dirs * 4  # projections
        total += self.slab_used * num_dirs * (4 + 4)  # run keys + ids
        total += self.slab_used * self.dim * 4  # keys in run-0 order
        total += (n + 1) * 3 * 8  # cluster start/size/capacity
        total += n * (4 + 8 + 8 + 8)  # level, parent, parent distance, descendants
        if self.mips:
            total += n * 4  # ext
        if self.table is not None:
            table = self.table
            total += table.id_capacity * (table.page_size + 1) * 8 + n * 2 * 8
        return int(total)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise AssertionError if a structural invariant is broken (docs/index.md, Invariants 4 and 11; O(n log n))."""
        n = self.num_points
        num_dirs = self.params.num_directions
        if n == 0:
            assert self.num_levels == 0 and (self.table is None or self.table.num_positions == 0)
            return
        lev = self.level_of[:n]
        par = self.parent_of[:n]
        top = self.num_levels - 1
        assert sum(self.level_counts) == n
        for level in range(self.num_levels):
            assert np.array_equal(np.sort(self.members(level)), np.flatnonzero(lev == level)), f"member list of level {level}"
        is_top = lev == top
        assert (par[is_top] == -1).all() and (par[~is_top] >= 0).all(), "only top-level points hang off the root"
        below_top = ~is_top
        assert (lev[par[below_top]] == lev[below_top] + 1).all(), "a parent is not on the next level up"
        if self.level1_rows:  # the packed copy of level 1 is the rows it copies
            packed = self.members(1)[: self.level1_rows]
            assert np.array_equal(self.level1_vectors[: self.level1_rows], self.vectors[packed]), "level 1 packed keys"
            assert np.array_equal(self.level1_ext[: self.level1_rows], self.ext[packed]), "level 1 packed lifts"
        # Stored projections equal recomputed ones.
        x = self.vectors[:n].astype(np.float64)
        if self.mips:
            ext = np.sqrt(np.maximum(self.msq - (x * x).sum(1), 0.0))
            assert ((x * x).sum(1) <= self.msq * (1 + 1e-12)).all(), "a key is longer than sqrt(msq)"
            assert np.allclose(self.ext[:n], ext, rtol=1e-5, atol=1e-5 * math.sqrt(max(self.msq, 1e-30)))
            x = np.concatenate([x, ext[:, None]], 1)
        proj = x @ self.dirs.T
        tol = 1e-6 * (1.0 + np.abs(x).max())
        assert np.allclose(self.proj[:n], proj, rtol=1e-6, atol=tol), "stored projections differ from recomputed ones"
        # Clusters: each run sorted by (key, id) and a permutation of the node's children.
        seen = np.zeros(n, np.int64)
        for cid in np.flatnonzero(self.cluster_size[: n + 1] > 0):
            node = int(cid) - 1
            kids0 = None
            for j in range(num_dirs):
                ids, keys = self.cluster(node, j)
                assert (keys[:-1] <= keys[1:]).all(), f"run {j} of cluster {node} is not sorted"
                tie = keys[:-1] == keys[1:]
                assert (ids[:-1][tie] < ids[1:][tie]).all(), f"run {j} of cluster {node}: ties not ordered by id"
                assert np.array_equal(keys, self.proj[ids, j]), "run keys differ from projections"
                if j == 0:
                    start = int(self.cluster_start[cid])
                    assert np.array_equal(self.vectors_run0[start : start + len(ids)], self.vectors[ids]), (
                        f"run-ordered keys of cluster {node} are stale"
                    )
                srt = np.sort(ids)
                if kids0 is None:
                    kids0 = srt
                else:
                    assert np.array_equal(srt, kids0), "runs of a cluster are not permutations of each other"
            assert (par[kids0] == node).all(), f"cluster {node} holds a point with another parent"
            assert self.cluster_size[cid] <= self.cluster_cap[cid]
            seen[kids0] += 1
        assert (seen == 1).all(), "every point is in exactly one cluster"
        assert (self.cluster_size[1 : n + 1][lev == 0] == 0).all(), "level-0 points own no cluster"
        # Descendant counts.
        below = np.zeros(n, np.int64)
        for level in range(top):
            ids = self.members(level)
            np.add.at(below, par[ids], 1 + below[ids])
        assert np.array_equal(below, self.num_descendants[:n]), "descendant counts are stale"
        assert int(below[self.members(top)].sum()) + self.level_counts[top] == n
        if self.table is not None:
            self._check_pages()

    def _check_pages(self) -> None:
        table = self.table
        assert table is not None
        n = self.num_points
        table.check()
        assert table.num_positions == n and (table.page_of_[:n] >= 0).all(), "every point is in a page"
        for cid in np.flatnonzero(self.cluster_size[: n + 1] > 0):
            ids, _ = self.cluster(int(cid) - 1, 0)
            pages = table.page_of_[ids]
            # Pages hold only this cluster's points (and, for projection pages, are contiguous in run-0 order).
            if self.params.page_split == "projection":
                change = np.flatnonzero(pages[1:] != pages[:-1])
                seq = np.concatenate([pages[:1], pages[change + 1]])
                assert len(np.unique(seq)) == len(seq), f"a page of cluster {int(cid) - 1} is not contiguous in run-0 order"
                # no two neighbouring pages that fit in one while one is under half full (dci_update._merge_small_page)
                sizes = table.sizes_[seq]
                small = (np.minimum(sizes[1:], sizes[:-1]) < table.page_size // 2) & (sizes[1:] + sizes[:-1] <= table.page_size)
                assert not small.any(), f"cluster {int(cid) - 1} has two neighbouring pages that fit in one, one under half full"
            else:
                seq = np.unique(pages)
            assert int(table.sizes_[seq].sum()) == len(ids), f"a page of cluster {int(cid) - 1} holds foreign points"


__all__ = ["DCITree", "lift_point"]


@njit(nogil=True, cache=True)
def lift_point(point: int, vectors: np.ndarray, dirs: np.ndarray, dim: int, msq: float, mips: bool, ext: np.ndarray,
               proj: np.ndarray) -> None:
    """`DCITree.lift` of the one id ``point``: float64 sums, stored as float32 (``ext`` only for MIPS)."""
    sq = 0.0
    for i in range(dim):
        sq += np.float64(vectors[point, i]) * np.float64(vectors[point, i])
    lifted = math.sqrt(max(msq - sq, 0.0)) if mips else 0.0
    if mips:
        ext[point] = lifted
    for m in range(dirs.shape[0]):
        s = 0.0
        for i in range(dim):
            s += np.float64(vectors[point, i]) * dirs[m, i]
        if mips:
            s += lifted * dirs[m, dim]
        proj[point, m] = s
