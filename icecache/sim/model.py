"""The SimPy timing model of one request: prefill pipeline, then decode steps, per variant.

Covers:
    ``full`` (all KV on the device), ``icecache`` (per sparse layer: insert -> select -> gather -> copy -> scatter
    -> attend), ``icecache-r`` (a selection made at one layer is reused by the next r - 1 sparse layers), and
    ``quest`` (token-order pages through the same offload path, the ``sequential`` pager). Prefill: device
    compute of layer l+1 || offload of layer l || index build of layer l.

Two implementations (`SimConfig.impl`), which differ in where the host work runs:

``runtime`` (default): what our runtime does per decode step and sparse layer (read from `cache.py`,
    `loader.py`, `prefill.py`): one ``pager.select`` per (batch row, KV head) *on the caller's thread*, one
    after another; the `BulkLoader`'s bookkeeping ("other"), one ``index_select`` per (row, KV head) with new
    tokens into one staging buffer ("gather"), one copy ("copy"), two ``index_copy_`` plus a validity-mask
    write ("scatter"); the window ring write on the caller's thread ("insert"); and the insertion of the
    token that leaves the window into the pagers and host stores, where `SimConfig.inserts` puts it (decided
    per machine as the runtime decides): in the background, the token leaving at the *next* step as one job
    per layer on the worker pool ("prefetch"), started after the layer's load and waited for when the layer is
    reached again one step later; or inline, the token leaving now on the caller's thread when the layer is
    reached ("insert"; a CPU whose cores all run the model). The first decode step after prefill inserts
    synchronously (nothing was prefetched) and waits for each layer's index build. Selections of ``icecache-r`` are reused, their loads are not
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

Two granularities (docs/simulator_anchors.md, Coarse and fine models): the *coarse* model raises one event per (layer, stage) and gives a
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
from dataclasses import asdict, dataclass, field
from typing import Any

from icecache.core.errors import ConfigError
from icecache.sim.config import SimConfig, layer_roles
from icecache.sim.costs import CostModel
from icecache.sim.engine import STAGES, simulate_request, simulate_step
from icecache.sim.hitrate import HitModel, HitStats, PriorHitModel, Trace, trace_step_loads
from icecache.sim.plans import plan_decode_step, plan_prefill
from icecache.sim.shapes import get_shape

__all__ = ["PAPER_COMPONENTS", "SimResult", "device_kv_bytes_by_role", "memory_bytes", "simulate"]

#: the paper's four components, as sums of our stages (prefetch overlaps and is left out)
PAPER_COMPONENTS: dict[str, tuple[str, ...]] = {
    "dci_query": ("select",),
    "decoding": ("attend", "dense_attend", "compute", "overhead"),
    "loading": ("gather", "copy", "scatter"),
    "other": ("insert", "other"),
}


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
        row["index"] = self.config.pager_name or ""
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
    for layer, role in enumerate(roles):
        if role == "sparse":
            out[role] += (cfg.sink + cfg.window) * per_layer + shape.kv_heads * slots * 2 * shape.head_dim * dtype
        else:
            out[role] += shape.attended_tokens(layer, n) * per_layer
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
    cfg: SimConfig, costs: CostModel, hit: HitModel | Trace | None = None, fine: bool = False, with_prefill: bool = True
) -> SimResult:
    """Simulate ``cfg`` with the cost model ``costs``.

    Parameters
    ----------
    cfg : SimConfig
        The configuration.
    costs : CostModel
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
    dtype = cfg.kv_dtype_bytes or costs.kv_dtype_bytes
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
