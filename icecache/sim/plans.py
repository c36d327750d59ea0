"""Plans: the stage times of one decode step and of a prefill, answered by a `CostModel` for a `SimConfig`.

A plan is passive data (per layer: jobs and seconds of every stage); `icecache.sim.engine` runs it.
`reuse_groups` groups the sparse layers that share one selection (``icecache-r``); `component_plan` spreads
the paper's per-step component totals over the layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from icecache.core.errors import ConfigError
from icecache.sim.config import SimConfig, layer_roles
from icecache.sim.costs import CostModel
from icecache.sim.hitrate import HitStats, LayerLoad, PriorHitModel
from icecache.sim.shapes import get_shape

__all__ = ["LayerPlan", "StepPlan", "PrefillLayer", "PrefillPlan", "reuse_groups", "plan_decode_step", "plan_prefill", "component_plan"]


@dataclass(frozen=True)
class LayerPlan:
    """Stage times of one layer in one decode step (seconds).

    ``select_jobs`` x ``select_job_s``: the index queries (one job per (row, KV head)); ``insert_jobs`` x
    ``insert_job_s``: the insertion of the token leaving the window into the pagers (one per (row, KV head)),
    plus ``insert_store_s`` for the page-table moves and host-store writes (runtime); ``append_s``: the synchronous window ring write; ``other_s``: the bulk loader's
    bookkeeping; ``overhead_s``: the runtime's untimed work of the layer.
    """

    kind: str  # "dense", "sliding" or "sparse"
    selects: bool = False
    compute_s: float = 0.0
    attend_s: float = 0.0
    insert_jobs: int = 0
    insert_job_s: float = 0.0
    insert_store_s: float = 0.0
    select_jobs: int = 0
    select_job_s: float = 0.0
    append_s: float = 0.0
    other_s: float = 0.0
    overhead_s: float = 0.0
    gather_s: float = 0.0
    copy_s: float = 0.0
    scatter_s: float = 0.0
    bytes: float = 0.0
    pages: float = 0.0


@dataclass(frozen=True)
class StepPlan:
    """One decode step: its layers, what follows them, and how the machine is shared.

    ``groups[l]`` lists the layers that use the selection made at layer ``l`` (``l`` first); ``index_of[l]``
    is the layer whose index layer ``l`` reads (itself unless it reuses). ``impl`` is ``"runtime"`` or
    ``"paper"`` (`SimConfig.impl`); ``prefetch`` lets the layers that reuse a selection load early (paper);
    ``background_share`` is the fraction of background pool work that holds a shared machine;
    ``inline_inserts``: the runtime inserts the token leaving the window on the caller's thread when the layer is
    reached (`SimConfig.inserts`), not on the pool one step ahead.
    """

    layers: tuple[LayerPlan, ...]
    head_s: float
    other_s: float
    threads: int
    efficiency: float
    shared: bool
    prefetch: bool
    groups: dict[int, tuple[int, ...]]
    index_of: dict[int, int]
    impl: str = "paper"
    background_share: float = 1.0
    inline_inserts: bool = False

    @property
    def has_background(self) -> bool:
        """Inserts run on the pool in the background (the runtime's prefetch)."""
        return (self.impl == "runtime" and not self.inline_inserts
                and any(lp.insert_jobs and lp.insert_job_s > 0 for lp in self.layers))


@dataclass(frozen=True)
class PrefillLayer:
    compute_s: float
    offload_s: float = 0.0
    build_jobs: int = 0
    build_job_s: float = 0.0
    #: the layer's prefill jobs as measured inside a real prefill on a shared machine (seconds the caller loses;
    #: replaces ``build_jobs`` there)
    inline_s: float = 0.0


@dataclass(frozen=True)
class PrefillPlan:
    layers: tuple[PrefillLayer, ...]
    head_s: float
    threads: int
    efficiency: float
    shared: bool
    background_share: float = 1.0


def reuse_groups(sparse: Sequence[int], reuse_every: int, variant: str) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """Reuse groups over the sparse layers (in order): every ``reuse_every`` consecutive sparse layers share the
    selection of the first (``icecache-r``; every other variant selects at each sparse layer), as
    `IceCache.reuse_leader` groups them."""
    r = reuse_every if variant == "icecache-r" else 1
    groups: dict[int, tuple[int, ...]] = {}
    index_of: dict[int, int] = {}
    sparse = list(sparse)
    for j, layer in enumerate(sparse):
        head = sparse[(j // r) * r]
        index_of[layer] = head
        groups[head] = groups.get(head, ()) + (layer,)
    return groups, index_of


def plan_decode_step(
    cfg: SimConfig, costs: CostModel, hit: HitStats | None = None, loads: dict[int, LayerLoad] | None = None,
    notes: list[str] | None = None,
) -> StepPlan:
    """Stage times of one decode step of ``cfg`` from ``costs`` and either ``hit`` (averages) or ``loads``
    (one replayed trace step: per-layer bytes and pages)."""
    shape = get_shape(cfg.model)
    dtype = cfg.kv_dtype_bytes or costs.kv_dtype_bytes
    n = cfg.decode_context
    mid = max(n - cfg.sink - cfg.window, 0)
    roles = layer_roles(shape, cfg.variant, cfg.dense_layers)
    sparse = [layer for layer, r in enumerate(roles) if r == "sparse"]
    groups, index_of = reuse_groups(sparse, cfg.reuse_every, cfg.variant)
    compute = costs.layer_compute_s(shape, notes)
    layers: list[LayerPlan] = []
    pager = cfg.pager_name
    runtime = cfg.impl == "runtime"
    if sparse:
        hs = hit or PriorHitModel().predict(cfg.variant, cfg.budget, cfg.page_size, n, notes)
        tok = min(cfg.budget, mid) * hs.budget_use
        pages_head = tok / (hs.fill * cfg.page_size) if tok else 0.0
        new_head = pages_head * (1.0 - hs.page_hit_rate)
        sel_job = costs.select_job_s(shape, pager, mid, cfg.budget, cfg.page_size, notes) if mid else 0.0
        ins_job = costs.insert_job_s(shape, pager, mid, notes) if mid else 0.0
        ins_store = costs.insert_store_s(shape, notes) if (mid and runtime) else 0.0
        append = costs.append_s(shape, notes) if runtime else 0.0
        overhead = costs.overhead_s(shape, notes, traced=cfg.trace) if runtime else 0.0
    for layer in range(shape.layers):
        if roles[layer] != "sparse":
            kv = shape.attended_tokens(layer, n)
            layers.append(LayerPlan(roles[layer], compute_s=compute, attend_s=costs.attend_s(shape, kv, in_model=True, notes=notes)))
            continue
        if loads is not None:
            ld = loads.get(layer)
            if ld is None:
                raise ConfigError(f"trace has no records for sparse layer {layer} (sparse layers: {sparse})")
            nbytes, npages, tok_l = float(ld.bytes), float(ld.new_pages), ld.tokens_per_head
            heads_new = float(ld.heads_with_new) if ld.heads_with_new is not None else (shape.kv_heads if nbytes else 0)
        else:
            nbytes = shape.kv_heads * new_head * shape.page_bytes(cfg.page_size, dtype)
            npages, tok_l = shape.kv_heads * new_head, tok
            heads_new = shape.kv_heads if nbytes else 0
        # rows of the runtime's token-granular gather and scatter: K+V of one token per row
        rows = nbytes / (2 * shape.head_dim * dtype)
        g_calls = cfg.gather_calls or int(math.ceil(heads_new))
        selects = index_of[layer] == layer
        # the runtime inserts at every sparse layer (each has its own pagers); the paper's model at selecting ones
        inserts = mid > 0 and (runtime or selects)
        layers.append(
            LayerPlan(
                "sparse",
                selects=selects,
                compute_s=compute,
                attend_s=costs.attend_s(shape, int(round(cfg.sink + cfg.window + tok_l)), in_model=False, notes=notes),
                insert_jobs=shape.kv_heads if inserts else 0,
                insert_job_s=ins_job,
                insert_store_s=ins_store if inserts else 0.0,
                select_jobs=shape.kv_heads if selects and mid else 0,
                select_job_s=sel_job,
                append_s=append,
                overhead_s=overhead,
                other_s=costs.loader_other_s(shape.kv_heads, shape.kv_heads * tok_l, notes) if runtime else 0.0,
                gather_s=costs.gather_s(nbytes, rows, g_calls if nbytes else 0, notes),
                copy_s=costs.copy_h2d_s(nbytes, cfg.copy_calls if nbytes else 0, notes),
                scatter_s=costs.scatter_s(nbytes, rows, cfg.scatter_calls if (nbytes or runtime) else 0, notes),
                bytes=nbytes,
                pages=npages,
            )
        )
    threads = min(cfg.threads, costs.host_threads)
    return StepPlan(
        layers=tuple(layers), head_s=costs.head_s(shape, notes), other_s=costs.step_other_s(shape, notes), threads=threads,
        efficiency=costs.pool_efficiency(threads, notes), shared=costs.shared, prefetch=not runtime,
        groups=groups, index_of=index_of, impl=cfg.impl, background_share=costs.background_share(notes),
        inline_inserts=runtime and not costs.background_inserts(cfg.inserts),
    )


def plan_prefill(cfg: SimConfig, costs: CostModel, notes: list[str] | None = None) -> PrefillPlan:
    """Stage times of the prefill pipeline of ``cfg``: per layer compute, offload of the middle KV, index build.

    The runtime submits one job per (row, KV head) of every sparse layer (offload into the host store + pager
    build); sliding and dense layers only compute. With ``impl="paper"`` layers that reuse a selection build no
    index (as the simulator modelled the paper)."""
    shape = get_shape(cfg.model)
    dtype = cfg.kv_dtype_bytes or costs.kv_dtype_bytes
    n = cfg.context
    mid = max(n - cfg.sink - cfg.window, 0)
    roles = layer_roles(shape, cfg.variant, cfg.dense_layers)
    _, index_of = reuse_groups([layer for layer, r in enumerate(roles) if r == "sparse"], cfg.reuse_every, cfg.variant)
    sparse_any = "sparse" in roles
    build = costs.build_job_s(shape, cfg.pager_name, mid, cfg.page_size, notes) if (sparse_any and mid) else 0.0
    # a shared machine whose profile timed real prefills: the jobs' measured cost inside a prefill, on the caller
    inline = (costs.prefill_inline_job_s(shape, cfg.pager_name, mid, notes)
              if (sparse_any and mid and costs.shared and cfg.impl == "runtime") else None)
    off = costs.copy_d2h_s(mid * shape.kv_bytes_per_token_layer(dtype), 1 if mid else 0, notes) if sparse_any else 0.0
    layers = []
    for layer in range(shape.layers):
        window = shape.sliding_window if roles[layer] == "sliding" else None
        g = costs.prefill_layer_s(shape, n, notes, window=window)
        if roles[layer] != "sparse":
            layers.append(PrefillLayer(g))
        else:
            builds = mid > 0 and (cfg.impl == "runtime" or index_of[layer] == layer)
            if inline is not None:
                layers.append(PrefillLayer(g, off, inline_s=shape.kv_heads * inline))
            else:
                layers.append(PrefillLayer(g, off, shape.kv_heads if builds else 0, build if builds else 0.0))
    threads = min(cfg.threads, costs.host_threads)
    return PrefillPlan(tuple(layers), costs.head_s(shape, notes), threads, costs.pool_efficiency(threads, notes), costs.shared,
                       costs.background_share(notes, phase="prefill") if cfg.impl == "runtime" else 1.0)


def component_plan(
    *, layers: int, select_s: float, decode_s: float, load_s: float, other_s: float, kv_heads: int = 8,
    threads: int = 64, dense_layers: Sequence[int] = (), reuse_every: int = 1, prefetch: bool = True,
) -> StepPlan:
    """A step plan from per-step component totals (the paper's breakdown), spread evenly over the layers
    (``impl="paper"``).

    ``select_s`` is spread over the selecting sparse layers as it would be measured without reuse (each sparse
    layer's share is ``select_s / sparse layers``), so a plan with ``reuse_every > 1`` runs fewer of those shares;
    ``decode_s`` over all layers (device), ``load_s`` over sparse layers (as gather), ``other_s`` per step.
    """
    dense = set(dense_layers)
    sparse_layers = [layer for layer in range(layers) if layer not in dense]
    sparse = len(sparse_layers)
    variant = "icecache-r" if reuse_every > 1 else "icecache"
    groups, index_of = reuse_groups(sparse_layers, reuse_every, variant)
    rounds = math.ceil(kv_heads / threads)
    out = []
    for layer in range(layers):
        if layer in dense:
            out.append(LayerPlan("dense", compute_s=decode_s / layers))
            continue
        sel = index_of[layer] == layer
        out.append(
            LayerPlan(
                "sparse", selects=sel, compute_s=decode_s / layers,
                select_jobs=kv_heads if sel else 0, select_job_s=select_s / sparse / rounds,
                gather_s=load_s / sparse,
            )
        )
    return StepPlan(tuple(out), 0.0, other_s, threads, 1.0, False, prefetch, groups, index_of)
