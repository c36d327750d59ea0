"""The SimPy timing model of one request: prefill pipeline, then decode steps, per variant.

Covers:
    ``full`` (all KV on the device), ``icecache`` (per sparse layer: insert -> select -> gather -> copy -> scatter
    -> attend), ``icecache-r`` (a selection made at one layer is reused by the next r - 1 sparse layers), and
    ``quest`` (token-order pages through the same offload path, the ``sequential`` pager). Prefill: device
    compute of layer l+1 || offload of layer l || index build of layer l.

Two implementations (`SimConfig.impl`), which differ in where the host work runs:

``runtime`` (default): what `icecache.runtime` does per decode step and sparse layer (read from `cache.py`,
    `loader.py`, `prefill.py`): one ``pager.select`` per (batch row, KV head) *on the caller's thread*, one
    after another; the `BulkLoader`'s bookkeeping ("other"), one ``index_select`` per (row, KV head) with new
    tokens into one staging buffer ("gather"), one copy ("copy"), two ``index_copy_`` plus a validity-mask
    write ("scatter"); the window ring write on the caller's thread ("insert"); and the insertion of the
    token that leaves the window at the *next* step into the pagers and host stores as one job per layer on
    the worker pool ("prefetch"), started after the layer's load and waited for when the layer is reached
    again one step later. The first decode step after prefill inserts synchronously (nothing was prefetched)
    and waits for each layer's index build. Selections of ``icecache-r`` are reused, their loads are not
    started early.
``paper``: the paper's implementation as the simulator modelled it before (IceCache paper, A100 breakdown):
    index queries and inserts of the KV heads on the thread pool, synchronous, and the pages of the layers that
    reuse a selection start loading as soon as it is known.

Scenario:
    Resources are the device (one compute stream), the host->device and device->host links (one copy engine
    each), and the host CPU thread pool. A stage holds its resource for a time answered by a cost model
    (`icecache.sim.costs`); the variants differ only in which stages exist and which events they wait on.
    On a CPU-only machine (``this-machine``) the device, the links and the pool are one shared resource; there
    background pool work (prefetched inserts, prefill index builds) holds it for ``background_share`` of its
    time (measured by the calibration; 1 when not measured: the one CPU resource does it all).

Hybrid models: sliding-window layers (`ModelShape.sliding_layers`) attend over ``min(context, window)`` tokens
through the model's own cache and are never offloaded or indexed; global layers run IceCache (or full KV).

Two granularities (SIM_ANCHORS.md s.7): the *coarse* model raises one event per (layer, stage) and gives a
pool stage of J jobs on T threads the closed-form makespan ``ceil(J/T) * t``, taking ``min(J, T)`` threads
from a `simpy.Container`; the *fine* model runs every job as its own process on a `simpy.Resource` of T
threads. They agree whenever the pool's rounds stay aligned (T divides J or J divides T); the fine one is the
test oracle.

Steady state: with prefetched inserts a step also pays for the previous step's background work, so the
engine runs two consecutive steps and reports the second (one step when there is no background work).

Stages reported per decode step (busy seconds, summed over layers): see `STAGES`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Generator, Sequence

import simpy

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.sim.costs import SCATTER_OPS
from icecache.sim.hardware import canonical_hardware
from icecache.sim.hitrate import HitModel, HitStats, LayerLoad, PriorHitModel, Trace, trace_step_loads
from icecache.sim.shapes import ModelShape, get_shape

VARIANTS: tuple[str, ...] = ("full", "icecache", "icecache-r", "quest")
IMPLS: tuple[str, ...] = ("runtime", "paper")
DEFAULT_PAGER: dict[str, str | None] = {"full": None, "icecache": "mdci", "icecache-r": "mdci", "quest": "sequential"}
#: Stages, in the runtime's names where the runtime times the same thing (`icecache.runtime.timing.STAGES`):
#: select, gather, copy, scatter, attend (sparse layers' attention over their device buffer), insert (the
#: synchronous part of the window insert), other (the bulk loader's bookkeeping and per-step host overhead).
#: Not timed by the runtime: dense_attend (attention through the model's own cache: dense, sliding and every
#: layer of ``full``), compute (projections, MLP, norms, LM head), overhead (untimed host work: per sparse
#: layer the runtime's entry points, accounting and prefetch submission; per step `transformers`' generate
#: loop) and prefetch (background inserts, pool work).
STAGES: tuple[str, ...] = ("select", "gather", "copy", "scatter", "attend", "dense_attend", "compute", "insert", "prefetch",
                           "overhead", "other")
#: the paper's four components, as sums of our stages (prefetch overlaps and is left out)
PAPER_COMPONENTS: dict[str, tuple[str, ...]] = {
    "dci_query": ("select",),
    "decoding": ("attend", "dense_attend", "compute", "overhead"),
    "loading": ("gather", "copy", "scatter"),
    "other": ("insert", "other"),
}


def parse_tokens(text: str | int) -> int:
    """``"36k"`` -> 36000, ``"1m"`` -> 1000000, ``"4096"`` -> 4096."""
    if isinstance(text, int):
        return text
    t = str(text).strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(t[-1:], 1)
    try:
        return int(round(float(t[:-1] if mult > 1 else t) * mult))
    except ValueError:
        raise ConfigError(f"cannot read a token count from {text!r} (examples: 4096, 36k, 1m)") from None


@dataclass(frozen=True)
class SimConfig:
    """One configuration to simulate.

    Parameters
    ----------
    model : str
        Model shape name (`icecache.sim.shapes`).
    hardware : str
        Hardware profile name (`icecache.sim.hardware`).
    variant : str
        One of `VARIANTS`.
    context : int
        Prompt tokens.
    budget, page_size, sink, window : int
        As in ICECACHE.md s.2 (tokens).
    threads : int
        CPU threads of the worker pool (index builds, prefetched inserts; index queries with ``impl="paper"``).
    dense_layers : int
        Global layers with index below ``dense_layers`` keep full attention on the device (the runtime's
        ``IceCacheConfig.dense_layers=(0, .., k-1)``; a sliding layer stays a sliding layer).
    reuse : int
        ``icecache-r``: sparse layers sharing one selection (the selecting layer included), >= 1.
    impl : str
        ``"runtime"`` (our runtime) or ``"paper"`` (the paper's implementation); see the module docstring.
    pager : str or None
        Pager whose measured costs stand for the index (None: `DEFAULT_PAGER` of the variant).
    new_tokens : int
        Generated tokens; TPOT is taken at the mean decode context ``context + new_tokens / 2``.
    kv_dtype_bytes : int
        Bytes per KV element; 0 takes the hardware's default.
    gather_calls : int
        ``index_select`` calls per sparse layer and step; 0 (default): one per KV head with new tokens, as the
        runtime's `BulkLoader` does (one per (batch row, KV head) into one staging buffer).
    copy_calls : int
        Host-to-device copies per sparse layer and step (the runtime: one, of the whole staging buffer).
    scatter_calls : int
        Scatter operations per sparse layer and step (the runtime: `SCATTER_OPS`, index_copy_ of K and V plus
        the validity-mask write; the mask is written even when nothing was copied).
    trace : bool
        The runtime records a selection trace (``IceCacheConfig(trace=True)``), which costs untimed host work
        per sparse layer (measured as ``overhead_traced``).
    """

    model: str
    hardware: str
    variant: str
    context: int
    budget: int = 256
    page_size: int = 16
    threads: int = 8
    sink: int = 4
    window: int = 64
    dense_layers: int = 2
    reuse: int = 4
    impl: str = "runtime"
    pager: str | None = None
    new_tokens: int = 32
    kv_dtype_bytes: int = 0
    gather_calls: int = 0
    copy_calls: int = 1
    scatter_calls: int = SCATTER_OPS
    trace: bool = False

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise UnknownNameError(f"unknown variant {self.variant!r}; known: {', '.join(VARIANTS)}")
        if self.impl not in IMPLS:
            raise UnknownNameError(f"unknown implementation {self.impl!r}; known: {', '.join(IMPLS)}")
        shape = get_shape(self.model)
        object.__setattr__(self, "model", shape.name)  # canonical names (aliases accepted)
        object.__setattr__(self, "hardware", canonical_hardware(self.hardware))
        ints = dict(
            context=(self.context, 1), budget=(self.budget, 0), page_size=(self.page_size, 1), threads=(self.threads, 1),
            sink=(self.sink, 0), window=(self.window, 1), dense_layers=(self.dense_layers, 0), reuse=(self.reuse, 1),
            new_tokens=(self.new_tokens, 1), kv_dtype_bytes=(self.kv_dtype_bytes, 0), gather_calls=(self.gather_calls, 0),
            copy_calls=(self.copy_calls, 0), scatter_calls=(self.scatter_calls, 0),
        )
        for name, (v, lo) in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"SimConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.budget > self.context:
            raise ConfigError(f"SimConfig.budget ({self.budget}) must not exceed the context ({self.context} tokens)")
        if self.dense_layers > shape.layers:
            raise ConfigError(f"SimConfig.dense_layers ({self.dense_layers}) exceeds the {shape.layers} layers of {shape.name}")

    @property
    def pager_name(self) -> str | None:
        return self.pager if self.pager is not None else DEFAULT_PAGER[self.variant]

    @property
    def decode_context(self) -> int:
        """Mean context over the decode steps TPOT averages."""
        return self.context + self.new_tokens // 2

    def replace(self, **changes: Any) -> "SimConfig":
        return replace(self, **changes)


def layer_roles(shape: ModelShape, variant: str, dense_layers: int) -> tuple[str, ...]:
    """Per layer: ``"sliding"`` (window KV through the model's cache), ``"dense"`` (full KV) or ``"sparse"``
    (IceCache), as `icecache.runtime.cache.IceCache` assigns them (sliding first, then ``dense_layers``)."""
    out = []
    for l in range(shape.layers):
        if shape.is_sliding(l):
            out.append("sliding")
        elif variant == "full" or l < dense_layers:
            out.append("dense")
        else:
            out.append("sparse")
    return tuple(out)


# ---------------------------------------------------------------------------------------------- plans
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
    ``background_share`` is the fraction of background pool work that holds a shared machine.
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

    @property
    def has_background(self) -> bool:
        """Inserts run on the pool in the background (the runtime's prefetch)."""
        return self.impl == "runtime" and any(lp.insert_jobs and lp.insert_job_s > 0 for lp in self.layers)


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


def _groups(sparse: Sequence[int], reuse: int, variant: str) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """Reuse groups over the sparse layers (in order): every ``reuse`` consecutive sparse layers share the
    selection of the first (``icecache-r``; every other variant selects at each sparse layer), as
    `IceCache.reuse_leader` groups them."""
    r = reuse if variant == "icecache-r" else 1
    groups: dict[int, tuple[int, ...]] = {}
    index_of: dict[int, int] = {}
    sparse = list(sparse)
    for j, l in enumerate(sparse):
        head = sparse[(j // r) * r]
        index_of[l] = head
        groups[head] = groups.get(head, ()) + (l,)
    return groups, index_of


def plan_decode_step(
    cfg: SimConfig, costs: Any, hit: HitStats | None = None, loads: dict[int, LayerLoad] | None = None,
    notes: list[str] | None = None,
) -> StepPlan:
    """Stage times of one decode step of ``cfg`` from ``costs`` and either ``hit`` (averages) or ``loads``
    (one replayed trace step: per-layer bytes and pages)."""
    shape = get_shape(cfg.model)
    dtype = cfg.kv_dtype_bytes or costs_dtype(costs, cfg)
    n = cfg.decode_context
    mid = max(n - cfg.sink - cfg.window, 0)
    roles = layer_roles(shape, cfg.variant, cfg.dense_layers)
    sparse = [l for l, r in enumerate(roles) if r == "sparse"]
    groups, index_of = _groups(sparse, cfg.reuse, cfg.variant)
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
    for l in range(shape.layers):
        if roles[l] != "sparse":
            kv = shape.attended_tokens(l, n)
            layers.append(LayerPlan(roles[l], compute_s=compute, attend_s=costs.attend_s(shape, kv, in_model=True, notes=notes)))
            continue
        if loads is not None:
            ld = loads.get(l)
            if ld is None:
                raise ConfigError(f"trace has no records for sparse layer {l} (sparse layers: {sparse})")
            nbytes, npages, tok_l = float(ld.bytes), float(ld.new_pages), ld.tokens_per_head
            heads_new = float(ld.heads_with_new) if ld.heads_with_new is not None else (shape.kv_heads if nbytes else 0)
        else:
            nbytes = shape.kv_heads * new_head * shape.page_bytes(cfg.page_size, dtype)
            npages, tok_l = shape.kv_heads * new_head, tok
            heads_new = shape.kv_heads if nbytes else 0
        # rows of the runtime's token-granular gather and scatter: K+V of one token per row
        rows = nbytes / (2 * shape.head_dim * dtype)
        g_calls = cfg.gather_calls or int(math.ceil(heads_new))
        selects = index_of[l] == l
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
        efficiency=costs.pool_efficiency(threads, notes), shared=is_shared(costs), prefetch=not runtime,
        groups=groups, index_of=index_of, impl=cfg.impl, background_share=costs.background_share(notes),
    )


def plan_prefill(cfg: SimConfig, costs: Any, notes: list[str] | None = None) -> PrefillPlan:
    """Stage times of the prefill pipeline of ``cfg``: per layer compute, offload of the middle KV, index build.

    The runtime submits one job per (row, KV head) of every sparse layer (offload into the host store + pager
    build); sliding and dense layers only compute. With ``impl="paper"`` layers that reuse a selection build no
    index (as the simulator modelled the paper)."""
    shape = get_shape(cfg.model)
    dtype = cfg.kv_dtype_bytes or costs_dtype(costs, cfg)
    n = cfg.context
    mid = max(n - cfg.sink - cfg.window, 0)
    roles = layer_roles(shape, cfg.variant, cfg.dense_layers)
    _, index_of = _groups([l for l, r in enumerate(roles) if r == "sparse"], cfg.reuse, cfg.variant)
    sparse_any = "sparse" in roles
    build = costs.build_job_s(shape, cfg.pager_name, mid, cfg.page_size, notes) if (sparse_any and mid) else 0.0
    # a shared machine whose profile timed real prefills: the jobs' measured cost inside a prefill, on the caller
    inline = (costs.prefill_inline_job_s(shape, cfg.pager_name, mid, notes)
              if (sparse_any and mid and is_shared(costs) and cfg.impl == "runtime") else None)
    off = costs.copy_d2h_s(mid * shape.kv_bytes_per_token_layer(dtype), 1 if mid else 0, notes) if sparse_any else 0.0
    layers = []
    for l in range(shape.layers):
        window = shape.sliding_window if roles[l] == "sliding" else None
        g = costs.prefill_layer_s(shape, n, notes, window=window)
        if roles[l] != "sparse":
            layers.append(PrefillLayer(g))
        else:
            builds = mid > 0 and (cfg.impl == "runtime" or index_of[l] == l)
            if inline is not None:
                layers.append(PrefillLayer(g, off, inline_s=shape.kv_heads * inline))
            else:
                layers.append(PrefillLayer(g, off, shape.kv_heads if builds else 0, build if builds else 0.0))
    threads = min(cfg.threads, costs.host_threads)
    return PrefillPlan(tuple(layers), costs.head_s(shape, notes), threads, costs.pool_efficiency(threads, notes), is_shared(costs),
                       costs.background_share(notes, phase="prefill") if cfg.impl == "runtime" else 1.0)


def costs_dtype(costs: Any, cfg: SimConfig) -> int:
    hw = getattr(costs, "hardware", None)
    if hw is not None:
        return int(hw.kv_dtype_bytes)
    return int(costs.profile.meta.get("dtype_bytes", 4))


def is_shared(costs: Any) -> bool:
    return getattr(costs, "hardware", None) is None


def component_plan(
    *, layers: int, select_s: float, decode_s: float, load_s: float, other_s: float, kv_heads: int = 8,
    threads: int = 64, dense_layers: int = 0, reuse: int = 1, prefetch: bool = True,
) -> StepPlan:
    """A step plan from per-step component totals (the paper's breakdown), spread evenly over the layers
    (``impl="paper"``).

    ``select_s`` is spread over the selecting sparse layers as it would be measured without reuse (each sparse
    layer's share is ``select_s / sparse layers``), so a plan with ``reuse > 1`` runs fewer of those shares;
    ``decode_s`` over all layers (device), ``load_s`` over sparse layers (as gather), ``other_s`` per step.
    """
    sparse = layers - dense_layers
    variant = "icecache-r" if reuse > 1 else "icecache"
    groups, index_of = _groups(range(dense_layers, layers), reuse, variant)
    rounds = math.ceil(kv_heads / threads)
    out = []
    for l in range(layers):
        if l < dense_layers:
            out.append(LayerPlan("dense", compute_s=decode_s / layers))
            continue
        sel = index_of[l] == l
        out.append(
            LayerPlan(
                "sparse", selects=sel, compute_s=decode_s / layers,
                select_jobs=kv_heads if sel else 0, select_job_s=select_s / sparse / rounds,
                gather_s=load_s / sparse,
            )
        )
    return StepPlan(tuple(out), 0.0, other_s, threads, 1.0, False, prefetch, groups, index_of)


# ---------------------------------------------------------------------------------------------- engine
class Machine:
    """The resources of one simulated machine and the stage primitives (generator methods)."""

    def __init__(self, env: simpy.Environment, threads: int, efficiency: float, shared: bool, fine: bool,
                 background_share: float = 1.0) -> None:
        self.env = env
        self.threads = max(1, threads)
        self.efficiency = efficiency
        self.shared = shared
        self.fine = fine
        self.background_share = min(max(background_share, 0.0), 1.0)
        self.busy: dict[str, float] = defaultdict(float)
        #: wall seconds from asking for a resource to releasing it, per stage: what a stage timer wrapped around
        #: the caller's code reads (it includes waiting for a CPU held by background work)
        self.timed: dict[str, float] = defaultdict(float)
        if shared:
            cpu = simpy.Resource(env, capacity=1)
            self.device = self.h2d = self.d2h = self.cpu = cpu
        else:
            self.device = simpy.Resource(env, capacity=1)
            self.h2d = simpy.Resource(env, capacity=1)
            self.d2h = simpy.Resource(env, capacity=1)
            self.cpu = None
            if fine:
                self.slots = simpy.Resource(env, capacity=self.threads)
            else:
                self.pool = simpy.Container(env, capacity=self.threads, init=self.threads)

    def hold(self, res: simpy.Resource, seconds: float, stage: str) -> Generator:
        """Hold ``res`` for ``seconds`` (FIFO) and book the time to ``stage``."""
        if seconds <= 0:
            return
        t0 = self.env.now
        with res.request() as req:
            yield req
            yield self.env.timeout(seconds)
        self.busy[stage] += seconds
        self.timed[stage] += self.env.now - t0

    def _job(self, seconds: float) -> Generator:
        with self.slots.request() as req:
            yield req
            yield self.env.timeout(seconds)

    def pool_stage(self, jobs: int, job_s: float, stage: str, scaled: bool = True, background: bool = False) -> Generator:
        """``jobs`` identical jobs of ``job_s`` on the thread pool (divided by the pool efficiency when ``scaled``).

        ``background``: work that runs beside the caller's thread; on a shared machine it holds the one CPU
        resource for ``background_share`` of its makespan and runs the rest without it."""
        if jobs <= 0 or job_s <= 0:
            return
        t = job_s / self.efficiency if scaled else job_s
        makespan = math.ceil(jobs / self.threads) * t
        start = self.env.now
        if self.shared:
            held = makespan * (self.background_share if background else 1.0)
            yield from self.hold(self.cpu, held, stage)
            if makespan > held:
                yield self.env.timeout(makespan - held)
                self.busy[stage] += makespan - held
                self.timed[stage] += makespan - held
        elif self.fine:
            yield self.env.all_of([self.env.process(self._job(t)) for _ in range(jobs)])
            self.busy[stage] += self.env.now - start
            self.timed[stage] += self.env.now - start
        else:
            k = min(jobs, self.threads)
            yield self.pool.get(k)
            yield self.env.timeout(makespan)
            yield self.pool.put(k)
            self.busy[stage] += makespan
            self.timed[stage] += self.env.now - start

    def host(self, seconds: float, stage: str) -> Generator:
        """Work on the caller's thread (Python, index queries of the runtime, bookkeeping)."""
        if self.shared:
            yield from self.hold(self.cpu, seconds, stage)
        elif seconds > 0:
            yield self.env.timeout(seconds)
            self.busy[stage] += seconds
            self.timed[stage] += seconds

    # -- processes
    def load(self, lp: LayerPlan, ready: simpy.Event | None = None, caller: bool = False) -> Generator:
        """Bulk load of one layer's new pages: bookkeeping -> gather -> one copy -> scatter.

        ``caller``: the gather runs on the caller's thread (the runtime) instead of one pool thread (paper).
        ``ready``: the layer's KV is on the host (its offload finished), when a prefill is still running."""
        if ready is not None:
            yield ready
        yield from self.host(lp.other_s, "other")
        if caller:
            yield from self.host(lp.gather_s, "gather")
        else:
            yield from self.pool_stage(1, lp.gather_s, "gather", scaled=False)
        yield from self.hold(self.h2d, lp.copy_s, "copy")
        yield from self.hold(self.device, lp.scatter_s, "scatter")

    def _background_insert(self, lp: LayerPlan) -> Generator:
        # the runtime submits one pool job per layer that inserts into every (row, KV head) one after another
        yield from self.pool_stage(1, lp.insert_jobs * lp.insert_job_s + lp.insert_store_s, "prefetch", scaled=False, background=True)

    def decode(
        self, plan: StepPlan, index_ready: Sequence[simpy.Event] | None = None,
        pending: dict[int, simpy.Process] | None = None, first: bool = False,
    ) -> Generator:
        """One decode step (all layers, LM head, per-step host work).

        ``index_ready[l]``: layer l's offload (and index build) is done; given when the step follows a prefill
        whose background work may still run. ``pending``: the previous step's background inserts per layer
        (waited for when the layer is reached; replaced by this step's). ``first``: the first step after
        prefill, whose inserts are synchronous (runtime)."""
        own = (lambda m: index_ready[m]) if index_ready is not None else (lambda m: None)
        runtime = plan.impl == "runtime"
        loads: dict[int, simpy.Process] = {}
        for l, lp in enumerate(plan.layers):
            yield from self.hold(self.device, lp.compute_s, "compute")
            if lp.kind != "sparse":
                yield from self.hold(self.device, lp.attend_s, "dense_attend")
                continue
            if runtime:
                if pending is not None and l in pending:
                    yield pending.pop(l)  # `pipeline.wait(layer)` in `_decode_append`
                if index_ready is not None:
                    yield index_ready[l]  # the same wait covers the layer's prefill jobs
                sync = lp.insert_jobs * lp.insert_job_s + lp.insert_store_s if (first or pending is None) else 0.0
                yield from self.host(lp.append_s + sync, "insert")
                yield from self.host(lp.overhead_s, "overhead")
                if lp.selects:
                    yield from self.host(lp.select_jobs * lp.select_job_s, "select")
                loads[l] = self.env.process(self.load(lp, None, caller=True))
                yield loads[l]
                if pending is not None and lp.insert_jobs:  # `_prefetch_insert`: the token leaving next step
                    pending[l] = self.env.process(self._background_insert(lp))
                    if self.shared:  # the worker starts at once and takes the CPU (the GIL) before attention
                        yield self.env.timeout(0)
                yield from self.hold(self.device, lp.attend_s, "attend")
                continue
            if lp.selects:
                if index_ready is not None:
                    yield index_ready[l]
                yield from self.pool_stage(lp.insert_jobs, lp.insert_job_s, "insert")
                yield from self.pool_stage(lp.select_jobs, lp.select_job_s, "select")
                members = plan.groups.get(l, (l,)) if plan.prefetch else (l,)
                for m in members:
                    if m not in loads:
                        loads[m] = self.env.process(self.load(plan.layers[m], own(m)))
            if l not in loads:
                loads[l] = self.env.process(self.load(lp, own(l)))
            yield loads[l]
            yield from self.hold(self.device, lp.attend_s, "attend")
        yield from self.hold(self.device, plan.head_s, "compute")
        # per-step host work: generate's loop (runtime: untimed overhead); the paper's breakdown calls it "other"
        yield from self.host(plan.other_s, "overhead" if runtime else "other")

    def _post(self, pl: PrefillLayer, ready: simpy.Event) -> Generator:
        yield from self.hold(self.d2h, pl.offload_s, "offload")
        yield from self.pool_stage(pl.build_jobs, pl.build_job_s, "build", background=True)
        ready.succeed()

    def prefill(
        self, plan: PrefillPlan, index_ready: Sequence[simpy.Event], first_token: simpy.Event, marks: dict[str, float]
    ) -> Generator:
        """Prefill: device compute per layer; each layer's offload and index build start behind it."""
        posts = []
        for l, pl in enumerate(plan.layers):
            yield from self.hold(self.device, pl.compute_s, "prefill")
            yield from self.hold(self.device, pl.inline_s, "build")
            posts.append(self.env.process(self._post(pl, index_ready[l])))
        yield from self.hold(self.device, plan.head_s, "prefill")
        marks["ttft"] = self.env.now
        first_token.succeed()
        yield self.env.all_of(posts)
        marks["prefill_end"] = self.env.now


@dataclass(frozen=True)
class StepResult:
    """Simulated decode step: its duration and the busy seconds of every stage."""

    seconds: float
    busy: dict[str, float]
    timed: dict[str, float] = field(default_factory=dict)


def simulate_step(plan: StepPlan, fine: bool = False) -> StepResult:
    """Run one steady-state decode step of ``plan`` on an otherwise idle machine.

    With background inserts (runtime) two consecutive steps run, the second waiting for the first one's
    inserts, and the second is reported (its duration; busy seconds are the mean of the two steps)."""
    env = simpy.Environment()
    m = Machine(env, plan.threads, plan.efficiency, plan.shared, fine, plan.background_share)
    steps = 2 if plan.has_background else 1
    ends: list[float] = []

    def run() -> Generator:
        pending: dict[int, simpy.Process] | None = {} if plan.impl == "runtime" else None
        for _ in range(steps):
            yield from m.decode(plan, pending=pending)
            ends.append(env.now)

    env.process(run())
    env.run()
    seconds = ends[-1] - (ends[-2] if len(ends) > 1 else 0.0)
    return StepResult(seconds, {s: m.busy.get(s, 0.0) / steps for s in STAGES}, {s: m.timed.get(s, 0.0) / steps for s in STAGES})


@dataclass(frozen=True)
class RequestResult:
    """Prefill, then the first decode step (waiting for the indexes it needs)."""

    ttft_s: float
    prefill_end_s: float
    tt2t_s: float
    busy: dict[str, float]


def simulate_request(prefill: PrefillPlan, step: StepPlan, fine: bool = False) -> RequestResult:
    """Prefill pipeline followed by the first decode step, on one machine (TTFT, end of index builds, TT2T)."""
    env = simpy.Environment()
    m = Machine(env, prefill.threads, prefill.efficiency, prefill.shared, fine, prefill.background_share)
    ready = [env.event() for _ in prefill.layers]
    marks: dict[str, float] = {}

    first_token = env.event()

    def request() -> Generator:
        p = env.process(m.prefill(prefill, ready, first_token, marks))
        yield first_token
        pending: dict[int, simpy.Process] | None = {} if step.impl == "runtime" else None
        yield from m.decode(step, ready, pending=pending, first=True)
        marks["tt2t"] = env.now
        yield p

    env.process(request())
    env.run()
    return RequestResult(marks["ttft"], marks["prefill_end"], marks["tt2t"], dict(m.busy))


# ---------------------------------------------------------------------------------------------- results
@dataclass
class SimResult:
    """Everything one simulated configuration reports (times in seconds, sizes in bytes).

    ``stages`` are busy seconds per step (the work of each stage); ``stage_timed`` the wall seconds a stage
    timer on the caller's thread would read (waits for a CPU held by background work included), the quantity
    the runtime's ``stage_seconds`` report. ``tpot_s`` is the steady-state decode step at the mean decode
    context; ``tpot_mean_s`` is TPOT as the runtime reports it, ``(end - TTFT) / (new_tokens - 1)``: the first decode step (TT2T - TTFT, which waits for
    the index builds and inserts synchronously) and ``new_tokens - 2`` steady steps (NaN without prefill).
    """

    config: SimConfig
    tpot_s: float
    ttft_s: float
    tt2t_s: float
    prefill_end_s: float
    stages: dict[str, float]
    bytes_per_step: float
    pages_per_step: float
    page_hit_rate: float
    weights_bytes: float
    device_kv_bytes: float
    host_kv_bytes: float
    full_kv_bytes: float
    fits_device: bool
    hit_source: str
    notes: list[str] = field(default_factory=list)
    tpot_mean_s: float = float("nan")
    stage_timed: dict[str, float] = field(default_factory=dict)

    @property
    def extrapolated(self) -> bool:
        """A predictor or the hit model was used outside the range it was measured or traced over."""
        return any("outside" in n for n in self.notes)

    @property
    def shape_scaled(self) -> bool:
        """Host costs were scaled from the measured model's shape to this model's."""
        return any(n.startswith("shape:") for n in self.notes)

    def components(self) -> dict[str, float]:
        """The per-step busy time grouped as the paper's four components."""
        return {k: sum(self.stages[s] for s in v) for k, v in PAPER_COMPONENTS.items()}

    def to_row(self) -> dict[str, Any]:
        row = {k: v for k, v in asdict(self.config).items()}
        row["pager"] = self.config.pager_name or ""
        row.update(
            tpot_s=self.tpot_s, tpot_mean_s=self.tpot_mean_s, ttft_s=self.ttft_s, tt2t_s=self.tt2t_s, prefill_end_s=self.prefill_end_s,
            **{f"stage_{s}_s": self.stages.get(s, 0.0) for s in STAGES},
            **{f"timed_{s}_s": self.stage_timed.get(s, 0.0) for s in STAGES},
            bytes_per_step=self.bytes_per_step, pages_per_step=self.pages_per_step, page_hit_rate=self.page_hit_rate,
            weights_bytes=self.weights_bytes, device_kv_bytes=self.device_kv_bytes, host_kv_bytes=self.host_kv_bytes,
            full_kv_bytes=self.full_kv_bytes, fits_device=self.fits_device, hit_source=self.hit_source,
            extrapolated=self.extrapolated, shape_scaled=self.shape_scaled, notes=" | ".join(sorted(set(self.notes))),
        )
        return row


def device_kv_bytes_by_role(cfg: SimConfig, dtype: int, hs: HitStats | None) -> dict[str, float]:
    """Device KV bytes of ``cfg`` at its decode context per layer role (`layer_roles`): sliding layers hold
    ``min(context, window)`` tokens (the attended window: ``window - 1`` cached plus the new token), dense
    layers the whole context, sparse layers sink + window + the budget slots (whole pages)."""
    shape = get_shape(cfg.model)
    n = cfg.decode_context
    per_layer = shape.kv_bytes_per_token_layer(dtype)
    roles = layer_roles(shape, cfg.variant, cfg.dense_layers)
    mid = max(n - cfg.sink - cfg.window, 0)
    fill = hs.fill if hs else 1.0
    slots = math.ceil(min(cfg.budget, mid) / (fill * cfg.page_size)) * cfg.page_size if mid else 0
    out = {"sliding": 0.0, "dense": 0.0, "sparse": 0.0}
    for l, role in enumerate(roles):
        if role == "sparse":
            out[role] += (cfg.sink + cfg.window) * per_layer + shape.kv_heads * slots * 2 * shape.head_dim * dtype
        else:
            out[role] += shape.attended_tokens(l, n) * per_layer
    return out


def memory_bytes(cfg: SimConfig, dtype: int, hs: HitStats | None) -> tuple[float, float, float, float]:
    """(weights, device KV, host KV, full KV) bytes of ``cfg`` at its decode context."""
    shape = get_shape(cfg.model)
    n = cfg.decode_context
    full_kv = float(shape.full_kv_bytes(n, dtype))
    weights = float(shape.total_params() * dtype)
    dev = sum(device_kv_bytes_by_role(cfg, dtype, hs).values())
    sparse = layer_roles(shape, cfg.variant, cfg.dense_layers).count("sparse")
    mid = max(n - cfg.sink - cfg.window, 0)
    return weights, float(dev), float(sparse * mid * shape.kv_bytes_per_token_layer(dtype)), full_kv


def simulate(
    cfg: SimConfig, costs: Any, hit: HitModel | Trace | None = None, fine: bool = False, with_prefill: bool = True
) -> SimResult:
    """Simulate ``cfg`` with the cost model ``costs``.

    Parameters
    ----------
    cfg : SimConfig
        The configuration.
    costs : MeasuredCosts or GpuCosts
        Built for ``cfg.hardware`` (`icecache.sim.hardware.make_costs`).
    hit : HitModel or Trace, optional
        Page hit statistics (parametric or prior) or a trace to replay step by step (TPOT is then the mean of
        the replayed steps). None: the prior (every selected page copied every step).
    fine : bool
        Use the per-head oracle engine.
    with_prefill : bool
        Also simulate the prefill pipeline and the first decode step (TTFT, TT2T); otherwise they are NaN.
    """
    notes: list[str] = []
    dtype = cfg.kv_dtype_bytes or costs_dtype(costs, cfg)
    hs: HitStats | None = None
    shape = get_shape(cfg.model)
    has_sparse = "sparse" in layer_roles(shape, cfg.variant, cfg.dense_layers)
    if has_sparse:
        if isinstance(hit, Trace):
            step_loads = trace_step_loads(hit)
            if not step_loads:
                raise ConfigError("empty trace")
            plans = [plan_decode_step(cfg, costs, loads=step_loads[s], notes=notes) for s in sorted(step_loads)]
            hs = None
        else:
            model = hit if hit is not None else PriorHitModel()
            hs = model.predict(cfg.variant, cfg.budget, cfg.page_size, cfg.decode_context, notes)
            plans = [plan_decode_step(cfg, costs, hit=hs, notes=notes)]
    else:
        plans = [plan_decode_step(cfg, costs, notes=notes)]
    steps = [simulate_step(p, fine) for p in plans]
    tpot = sum(s.seconds for s in steps) / len(steps)
    stages = {k: sum(s.busy[k] for s in steps) / len(steps) for k in STAGES}
    timed = {k: sum(s.timed[k] for s in steps) / len(steps) for k in STAGES}
    bytes_step = sum(sum(lp.bytes for lp in p.layers) for p in plans) / len(plans)
    pages_step = sum(sum(lp.pages for lp in p.layers) for p in plans) / len(plans)
    if isinstance(hit, Trace) and has_sparse:
        sel = sum(len(r["pages"]) for r in hit.records)
        hit_rate = 1.0 - sum(int(r["new_pages"]) for r in hit.records) / sel if sel else 0.0
        hit_source = f"trace replay ({len(plans)} steps)"
    else:
        hit_rate = hs.page_hit_rate if hs else float("nan")
        hit_source = hs.source if hs else ""
    if with_prefill:
        req = simulate_request(plan_prefill(cfg, costs, notes), plans[0], fine)
        ttft, tt2t, pend = req.ttft_s, req.tt2t_s, req.prefill_end_s
        k = max(cfg.new_tokens - 1, 1)
        tpot_mean = ((tt2t - ttft) + (k - 1) * tpot) / k
    else:
        ttft = tt2t = pend = tpot_mean = float("nan")
    weights, dev_kv, host_kv, full_kv = memory_bytes(cfg, dtype, hs)
    cap = costs.device_memory_bytes
    fits = True if cap is None else (weights + dev_kv) <= cap
    if not fits:
        notes.append(f"memory: weights + device KV = {(weights + dev_kv) / 1e9:.1f} GB > {cap / 1e9:.0f} GB device")
    return SimResult(
        config=cfg, tpot_s=tpot, ttft_s=ttft, tt2t_s=tt2t, prefill_end_s=pend, stages=stages, bytes_per_step=bytes_step,
        pages_per_step=pages_step, page_hit_rate=hit_rate, weights_bytes=weights, device_kv_bytes=dev_kv,
        host_kv_bytes=host_kv, full_kv_bytes=full_kv, fits_device=fits, hit_source=hit_source, notes=notes,
        tpot_mean_s=tpot_mean, stage_timed=timed,
    )
