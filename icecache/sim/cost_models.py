"""The two cost models (`icecache.sim.costs.CostModel`): `MeasuredCosts` answers every stage time from a
`CalibrationProfile` (the measured machine itself is the "device": the CPU runtime); `GpuCosts` answers device
and link times from a `HardwareProfile`'s constants and host-side times (index queries, gather) from a measured
profile scaled by the host's speed. The closed forms they use are in `icecache.sim.closed_forms`, the fitted
formulas in `icecache.sim.predictors`. Units: seconds (``_s``), bytes, bytes per second (``_Bps``), tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from icecache.core.errors import ConfigError
from icecache.sim.closed_forms import transfer_time_s
from icecache.sim.costs import RING_WRITES, CostModel, Notes
from icecache.sim.predictors import check_policy
from icecache.sim.profile import CalibrationProfile
from icecache.sim.shapes import ModelShape, get_shape, shape_from_dict

__all__ = ["MeasuredCosts", "GpuCosts"]


def _note(notes: Notes, text: str) -> None:
    if notes is not None and text not in notes:
        notes.append(text)


@dataclass(frozen=True)
class MeasuredCosts(CostModel):
    """Stage costs answered from a `CalibrationProfile` (the measured machine runs everything on its CPU).

    Predictor names used: ``decode_step`` (context), ``attention`` (kv_tokens), ``lm_head`` (constant),
    ``prefill`` (tokens), ``select/<pager>`` (n, budget, page_size), ``build/<pager>`` (n, page_size),
    ``insert/<pager>`` (n), when measured ``select_decode/<pager>`` and ``insert_decode/<pager>`` (n: the pager
    timed inside the runtime's decode, see `select_job_s`), ``gather`` (bytes, rows per call), ``copy`` (bytes), ``scatter`` (bytes, rows per
    call), and when measured ``loader_other`` (heads, tokens: the bulk loader's bookkeeping per layer) and
    ``append`` and ``overhead`` (heads: the window ring write and the untimed runtime work per layer);
    ``meta["background_share"]`` is the measured fraction of background pool work that slows the caller's
    thread down (see `background_share`).

    The decode step of the measured model is split into its parts without new assumptions: per-layer
    attention intercept from ``attention``, LM head from ``lm_head``, the remainder of the step intercept as
    per-layer compute; the in-model per-token attention cost is the step's slope over layers (it includes the
    cache update the model performs). A model of another shape is scaled by weight and KV-byte ratios and
    every answer is then noted as a shape extrapolation.

    Parameters
    ----------
    profile : CalibrationProfile
        Measurements.
    extrapolation : {"refuse", "warn", "allow"}
        Policy for points outside the measured ranges.
    """

    profile: CalibrationProfile
    extrapolation: str = "warn"

    def __post_init__(self) -> None:
        check_policy(self.extrapolation)

    # -- helpers
    def _p(self, name: str, x: Sequence[float], notes: Notes) -> float:
        return self.profile.predictor(name).predict(x, self.extrapolation, notes)  # type: ignore[arg-type]

    @property
    def measured_shape(self) -> ModelShape:
        """Shape of the model the profile timed (stored in its meta; a registered name otherwise)."""
        if "shape" in self.profile.meta:
            return shape_from_dict(self.profile.meta["shape"])
        return get_shape(self.profile.meta.get("model", "smollm2-135m-instruct"))

    def _shape_ratio(self, shape: ModelShape, what: str, notes: Notes) -> float:
        ref = self.measured_shape
        if shape.name == ref.name:
            return 1.0
        _note(notes, f"shape: {shape.name} {what} scaled from the measured {ref.name}")
        if what == "weights":
            return shape.layer_params() / ref.layer_params()
        if what == "head":
            return shape.head_params() / ref.head_params()
        if what == "kv":
            return shape.kv_bytes_per_token_layer(1) / ref.kv_bytes_per_token_layer(1)
        if what == "query":  # index query/insert work: queries per select times head width
            return (shape.group_size * shape.head_dim) / (ref.group_size * ref.head_dim)
        if what == "build":
            return shape.head_dim / ref.head_dim
        raise ValueError(what)

    @property
    def host_threads(self) -> int:
        return int(self.profile.machine.get("cpu_count", 1))

    @property
    def device_memory_bytes(self) -> float | None:
        return None

    @property
    def kv_dtype_bytes(self) -> int:
        return int(self.profile.meta.get("dtype_bytes", 4))

    @property
    def shared(self) -> bool:
        return True

    @property
    def free_cores(self) -> int:
        """CPU cores the calibrated torch threads left free (``machine["torch_threads"]``; 0 when not recorded)."""
        machine = self.profile.machine
        if "torch_threads" not in machine:
            return 0
        return max(int(machine.get("cpu_count", 1)) - int(machine["torch_threads"]), 0)

    # -- device side (here: the CPU)
    def layer_compute_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """Non-attention work of one decode layer (norms, projections, MLP, framework overhead)."""
        ref = self.measured_shape
        step0 = self.profile.predictor("decode_step").params[0]
        per_layer = (step0 - self.profile.predictor("lm_head").params[0]) / ref.layers - self.profile.predictor(
            "attention"
        ).params[0]
        return max(per_layer, 0.0) * self._shape_ratio(shape, "weights", notes)

    def attend_s(self, shape: ModelShape, tokens: int, *, in_model: bool, notes: Notes = None) -> float:
        """Attention of one layer over ``tokens`` keys: through the model's own cache (``in_model``, full and
        dense layers) or as a standalone kernel over gathered pages (sparse layers)."""
        ref = self.measured_shape
        att = self.profile.predictor("attention")
        kv = self._shape_ratio(shape, "kv", notes)
        if in_model:
            step = self.profile.predictor("decode_step")
            step.predict([tokens], self.extrapolation, notes)  # type: ignore[arg-type]  # range check only
            return att.params[0] + step.params[1] / ref.layers * tokens * kv
        if "sparse_attention" in self.profile.predictors:  # the runtime's CPU kernel, measured as it runs
            sp = self.profile.predictor("sparse_attention")
            ratio = 1.0 if shape.name == ref.name else (shape.q_heads * shape.head_dim) / (ref.q_heads * ref.head_dim)
            return sp.params[0] + (self._p("sparse_attention", [tokens], notes) - sp.params[0]) * ratio
        _note(notes, "sparse attention: profile has no 'sparse_attention' kernel timing; the model's attention used")
        return att.params[0] + (self._p("attention", [tokens], notes) - att.params[0]) * kv

    def head_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """Final norm and LM head, once per step."""
        return self.profile.predictor("lm_head").params[0] * self._shape_ratio(shape, "head", notes)

    def step_other_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """Per-step host work of `transformers`' ``generate`` loop beyond the model's forward (logits processing,
        stopping criteria, input bookkeeping): the ``step_other`` predictor; 0 (noted) when not measured."""
        if "step_other" not in self.profile.predictors:
            _note(notes, "generate's per-step overhead not measured; counted as 0")
            return 0.0
        return self._p("step_other", [], notes)

    def prefill_layer_s(self, shape: ModelShape, tokens: int, notes: Notes = None, window: int | None = None) -> float:
        """Prefill of one layer over ``tokens`` prompt tokens. ``window`` (a sliding layer) does not change the
        time here: transformers' SDPA path applies the window as a mask over the causal attention, so the CPU
        computes every score anyway."""
        ref = self.measured_shape
        # time to first token through ``generate`` when the profile measured real prefills, else model forwards
        name = "prefill_generate" if "prefill_generate" in self.profile.predictors else "prefill"
        total = self._p(name, [tokens], notes) - self.profile.predictor("lm_head").params[0]
        return max(total, 0.0) / ref.layers * self._shape_ratio(shape, "weights", notes)

    # -- host side
    def _pager_name(self, pager: str, kind: str, notes: Notes) -> str:
        name = f"{kind}/{pager}"
        if name in self.profile.predictors:
            return name
        raise ConfigError(
            f"the calibration profile has no {kind} cost for pager {pager!r} (measured: {', '.join(self.profile.pagers)});"
            " calibrate with that pager present or choose another with --pager"
        )

    def select_job_s(self, shape: ModelShape, pager: str, n: int, budget: int, page_size: int, notes: Notes = None) -> float:
        """One KV head's index query (its GQA group's queries) over ``n`` indexed tokens.

        When the profile timed the pager inside the runtime's decode (calibration component ``decode_index``:
        real generations over prompts of n indexed tokens per head), the round-robin select cost is scaled by
        ``select_decode(n) / select(n)`` at the budget and page size of that timing: a select between the
        model's work and the other heads' selects runs slower than one index timed alone. Outside the sizes that
        timing measured the factor is held at its nearest measured size (noted): extrapolating the in-step fit
        alone would let its last segment's slope, not the round-robin select measured that far, set the growth."""
        name = self._pager_name(pager, "select", notes)
        t = self._p(name, [max(n, 1), max(budget, 1), page_size], notes)
        dec = f"select_decode/{pager}"
        if dec in self.profile.predictors:
            ref = self.profile.decode_index_settings(pager)
            m = self._in_decode_size(dec, n, notes)
            t *= self._p(dec, [m], notes) / self._p(name, [m, ref["budget"], ref["page_size"]], notes)
        return t * self._shape_ratio(shape, "query", notes)

    def _in_decode_size(self, dec: str, n: int, notes: Notes) -> float:
        """``n`` clamped into the sizes the ``decode_index`` timing ``dec`` measured (noted when clamped)."""
        pred = self.profile.predictor(dec)
        lo, hi = float(pred.lo[0]), float(pred.hi[0])
        m = min(max(float(max(n, 1)), lo), hi)
        if m != max(n, 1):
            _note(notes, f"{dec}: in-step factor at n={n} held at its measured edge n={m:.0f}")
        return m

    def decode_step_in_runtime_s(self, pager: str, n: int, notes: Notes = None) -> float:
        """One whole decode step (seconds) of the calibration's own model under the runtime, every layer sparse,
        at ``n`` indexed tokens per KV head (``step_decode/<pager>``, fitted from the ``decode_index`` timing's
        steps): what a fresh generation of that size costs, the index's effect on the rest of the step included.
        Only for runs of that model with that timing's budget and page size (no shape scaling)."""
        name = f"step_decode/{pager}"
        if name not in self.profile.predictors:
            raise ConfigError(f"the calibration profile has no {name} (measured with component 'decode_index' since "
                              f"2026-11; has: {', '.join(sorted(k for k in self.profile.predictors if '_decode/' in k)) or 'none'})")
        return self._p(name, [max(n, 1)], notes)

    def build_job_s(self, shape: ModelShape, pager: str, n: int, page_size: int, notes: Notes = None) -> float:
        """One KV head's prefill job over ``n`` tokens: the index build, plus writing the K/V into the host store's
        pages when the profile measured that (``store_sync``; older profiles: the build only, noted)."""
        name = self._pager_name(pager, "build", notes)
        build = self._p(name, [max(n, 1), page_size], notes) * self._shape_ratio(shape, "build", notes)
        if "store_sync" not in self.profile.predictors:
            _note(notes, "host-store writes of prefill jobs not measured; counted as 0")
            return build
        return build + self._p("store_sync", [max(n, 1)], notes) * self._shape_ratio(shape, "build", notes)

    def prefill_inline_job_s(self, shape: ModelShape, pager: str, n: int, notes: Notes = None) -> float | None:
        """What one prefill job (one sparse layer's KV head, ``n`` tokens) adds to a real prefill on this machine,
        where compute and the jobs share the cores (``prefill_inline/<pager>``, measured by the calibration's
        "pipeline" component); None when the profile did not measure it (the simulator then composes the
        prefill from isolated job times, `build_job_s`)."""
        name = f"prefill_inline/{pager}"
        if name not in self.profile.predictors:
            return None
        return self._p(name, [max(n, 1)], notes) * self._shape_ratio(shape, "build", notes)

    def insert_job_s(self, shape: ModelShape, pager: str, n: int, notes: Notes = None) -> float:
        """Insertion of one token (leaving the window) into one KV head's index of ``n`` tokens (timed inside
        the runtime's decode when the profile has ``insert_decode/<pager>``; outside that timing's sizes, the
        round-robin ``insert/<pager>`` scaled by the in-step factor at the nearest measured size, as in
        `select_job_s`)."""
        dec, base = f"insert_decode/{pager}", f"insert/{pager}"
        name = dec if dec in self.profile.predictors else base
        if name not in self.profile.predictors:
            _note(notes, f"no insert cost measured for {pager}; counted as 0")
            return 0.0
        ratio = self._shape_ratio(shape, "build", notes)
        if name == dec and base in self.profile.predictors:
            m = self._in_decode_size(dec, n, notes)
            if m != max(n, 1):
                return self._p(base, [max(n, 1)], notes) * self._p(dec, [m], notes) / self._p(base, [m], notes) * ratio
        return self._p(name, [max(n, 1)], notes) * ratio

    def _per_layer(self, name: str, what: str, shape: ModelShape, notes: Notes) -> float:
        if name not in self.profile.predictors:
            _note(notes, f"no {what} cost measured; counted as 0")
            return 0.0
        pred = self.profile.predictor(name)
        return self._p(name, [float(shape.kv_heads)] if pred.features else [], notes)

    def append_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """The synchronous part of the runtime's window insert per sparse layer and step (ring write of K, V and
        mask, sink bookkeeping): the ``append`` predictor at the shape's KV heads, 0 (noted) when not measured."""
        return self._per_layer("append", "window-append", shape, notes)

    def insert_store_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """The runtime's insert job per sparse layer beyond the pager inserts (page-table moves, host-store sync
        of every (row, KV head)): the ``insert_store`` predictor at the shape's KV heads, 0 (noted) when not
        measured."""
        return self._per_layer("insert_store", "host-store insert", shape, notes)

    def overhead_s(self, shape: ModelShape, notes: Notes = None, traced: bool = False) -> float:
        """The runtime's untimed work per sparse layer and step (cache and attention entry points, accounting,
        the prefetch job's submission): the ``overhead`` predictor at the shape's KV heads (``overhead_traced``
        when the run records a selection trace), 0 (noted) when not measured."""
        if traced and "overhead_traced" in self.profile.predictors:
            return self._per_layer("overhead_traced", "per-layer runtime overhead with a trace", shape, notes)
        if traced:
            _note(notes, "per-layer overhead of a traced run not measured; the untraced one is used")
        return self._per_layer("overhead", "per-layer runtime overhead", shape, notes)

    def loader_other_s(self, heads: int, tokens: float, notes: Notes = None) -> float:
        """The bulk loader's bookkeeping for one layer (residency per (row, KV head) over ``tokens`` selected
        tokens in all): the ``loader_other`` predictor, 0 (noted) when the profile has none."""
        if "loader_other" not in self.profile.predictors:
            _note(notes, "no loader bookkeeping cost measured; counted as 0")
            return 0.0
        return self._p("loader_other", [heads, tokens], notes)

    def background_share(self, notes: Notes = None, phase: str = "decode") -> float:
        """Fraction of background pool work by which it delays the caller's thread on this machine, as measured
        by the calibration: ``meta["background_share"]`` for decode (prefetched inserts beside decode steps),
        ``meta["background_share_prefill"]`` for prefill (index builds beside the prefill); 1 (the work shares
        the one CPU resource with everything else, serially) when it was not measured."""
        key = "background_share" if phase == "decode" else "background_share_prefill"
        v = self.profile.meta.get(key)
        if v is None:
            _note(notes, f"{key} not measured: background pool work counted as serial (1)")
            return 1.0
        return min(max(float(v), 0.0), 1.0)

    def pool_efficiency(self, threads: int, notes: Notes = None) -> float:
        """Parallel efficiency of ``threads`` pool threads (job time is divided by it), as measured."""
        eff = {int(k): float(v) for k, v in self.profile.meta.get("pool_efficiency", {"1": 1.0}).items()}
        t = min(threads, max(eff))
        if threads > max(eff):
            _note(notes, f"pool efficiency measured up to {max(eff)} threads; {threads} uses that value")
        return eff.get(t, eff[max(k for k in eff if k <= t)])

    def gather_s(self, nbytes: float, rows: float, calls: int, notes: Notes = None) -> float:
        """Gather of ``rows`` index rows (``nbytes``) from the host store into staging, in ``calls``
        index_select calls (the runtime: one per (row, KV head), a row being one token's K and V)."""
        if calls == 0 or nbytes == 0:
            return 0.0
        return calls * self._p("gather", [nbytes / calls, rows / calls], notes)

    def copy_h2d_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        """Host-to-device copy (here a host tensor copy)."""
        if calls == 0 or nbytes == 0:
            return 0.0
        return calls * self._p("copy", [nbytes / calls], notes)

    def copy_d2h_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        """Device-to-host copy (offload; here the same host tensor copy)."""
        return self.copy_h2d_s(nbytes, calls, notes)

    def scatter_s(self, nbytes: float, rows: float, calls: int, notes: Notes = None) -> float:
        """Scatter of staged rows into their device slots in ``calls`` operations (``index_copy_`` of K and V,
        validity mask); with ``nbytes == 0`` only the mask write is left, which the runtime still does."""
        if calls == 0:
            return 0.0
        return calls * self._p("scatter", [nbytes / calls, rows / calls], notes)


@dataclass(frozen=True)
class GpuCosts(CostModel):
    """Stage costs of a GPU server: device and link from hardware constants, host work from measurements.

    Device (per decode layer): ``layer_overhead + layer weight bytes / achieved HBM bandwidth`` for the
    non-attention work and ``tokens * KV bytes / (peak HBM bandwidth * attention efficiency)`` for attention
    (docs/simulator_anchors.md, Decode is not at the roofline: decode is dispatch- and implementation-bound, so both constants are fitted to
    measured full-KV runs, not taken from the roofline). Prefill: FLOPs / (peak * MFU). Link: ``alpha + bytes /
    bandwidth`` per call. Host: the measured profile's index and gather costs times the host's time scale.

    Parameters
    ----------
    hardware : HardwareProfile
        Constants (see `icecache.sim.hardware`).
    host : MeasuredCosts
        Host-side measurements (this machine) to scale.
    host_time_scale : float
        Host index-work time relative to ``host`` (resolved by `icecache.sim.hardware.resolve_host_scale`).
    """

    hardware: Any
    host: MeasuredCosts
    host_time_scale: float = 1.0

    @property
    def extrapolation(self) -> str:
        return self.host.extrapolation

    @property
    def host_threads(self) -> int:
        return int(self.hardware.host.threads.value)

    @property
    def device_memory_bytes(self) -> float | None:
        return float(self.hardware.device.memory_bytes.value)

    @property
    def kv_dtype_bytes(self) -> int:
        return int(self.hardware.kv_dtype_bytes)

    @property
    def shared(self) -> bool:
        return False

    def _dtype(self) -> int:
        return int(self.hardware.kv_dtype_bytes)

    def layer_compute_s(self, shape: ModelShape, notes: Notes = None) -> float:
        dev = self.hardware.device
        return dev.layer_overhead_s.value + shape.layer_params() * self._dtype() / dev.hbm_achieved_Bps.value

    def attend_s(self, shape: ModelShape, tokens: int, *, in_model: bool, notes: Notes = None) -> float:
        dev = self.hardware.device
        bw = dev.hbm_peak_Bps.value * dev.attn_bw_efficiency.value
        return tokens * shape.kv_bytes_per_token_layer(self._dtype()) / bw

    def head_s(self, shape: ModelShape, notes: Notes = None) -> float:
        return shape.head_params() * self._dtype() / self.hardware.device.hbm_achieved_Bps.value

    def step_other_s(self, shape: ModelShape, notes: Notes = None) -> float:
        return self.hardware.device.step_overhead_s.value

    def prefill_layer_s(self, shape: ModelShape, tokens: int, notes: Notes = None, window: int | None = None) -> float:
        """Prefill FLOPs of one layer over the device; a sliding layer (``window``) computes only the scores
        inside its window (flash attention skips the masked blocks)."""
        dev = self.hardware.device
        att = shape.prefill_attention_flops(tokens, window) if window else shape.attention_flops(tokens, tokens, causal=True)
        flops = shape.layer_flops_per_token() * tokens + att
        return dev.layer_overhead_s.value + flops / (dev.peak_flops.value * dev.prefill_mfu.value)

    def select_job_s(self, shape: ModelShape, pager: str, n: int, budget: int, page_size: int, notes: Notes = None) -> float:
        return self.host_time_scale * self.host.select_job_s(shape, pager, n, budget, page_size, notes)

    def build_job_s(self, shape: ModelShape, pager: str, n: int, page_size: int, notes: Notes = None) -> float:
        return self.host_time_scale * self.host.build_job_s(shape, pager, n, page_size, notes)

    def insert_job_s(self, shape: ModelShape, pager: str, n: int, notes: Notes = None) -> float:
        return self.host_time_scale * self.host.insert_job_s(shape, pager, n, notes)

    def append_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """Window ring write: `RING_WRITES` small device writes per sparse layer."""
        return RING_WRITES * self.hardware.device.kernel_launch_s.value

    def loader_other_s(self, heads: int, tokens: float, notes: Notes = None) -> float:
        """The bulk loader's host bookkeeping, as measured here times the host's gather scale."""
        return self.hardware.host.gather_scale.value * self.host.loader_other_s(heads, tokens, notes)

    def insert_store_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """The host-store part of the insert job, as measured here times the host's gather scale."""
        return self.hardware.host.gather_scale.value * self.host.insert_store_s(shape, notes)

    def overhead_s(self, shape: ModelShape, notes: Notes = None, traced: bool = False) -> float:
        """The runtime's untimed host work per sparse layer, as measured here times the host's gather scale."""
        return self.hardware.host.gather_scale.value * self.host.overhead_s(shape, notes, traced)

    def background_share(self, notes: Notes = None, phase: str = "decode") -> float:
        """Unused off a shared machine (the pool, the caller's thread and the device are separate resources)."""
        return 1.0

    def pool_efficiency(self, threads: int, notes: Notes = None) -> float:
        return float(self.hardware.host.pool_efficiency.value)

    def gather_s(self, nbytes: float, pages: float, calls: int, notes: Notes = None) -> float:
        return self.hardware.host.gather_scale.value * self.host.gather_s(nbytes, pages, calls, notes)

    def copy_h2d_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        link = self.hardware.link
        return transfer_time_s(nbytes, calls if nbytes else 0, link.h2d_alpha_s.value, link.h2d_Bps.value)

    def copy_d2h_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        link = self.hardware.link
        return transfer_time_s(nbytes, calls if nbytes else 0, link.d2h_alpha_s.value, link.d2h_Bps.value)

    def scatter_s(self, nbytes: float, pages: float, calls: int, notes: Notes = None) -> float:
        dev = self.hardware.device
        return transfer_time_s(nbytes, calls, dev.kernel_launch_s.value, dev.hbm_achieved_Bps.value / 2)
