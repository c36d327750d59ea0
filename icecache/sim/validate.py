"""``python -m icecache.sim validate``: predict measured runs of the runtime and score the predictions.

Input: JSON lines, one measured run each (``experiments/sim/measure_runs.py`` writes them; the runs the package
ships, ``icecache/sim/data/measured_runs.jsonl`` (`icecache.sim.profile.default_runs_path`), are the default)::

    {"variant": "icecache", "model": "smollm2-135m-instruct", "context": 4096, "budget": 256, "page_size": 16,
     "threads": 2, "new_tokens": 32, "tpot_s": 0.061, "tt2t_s": 3.1, "ttft_s": 3.0,
     "stage_seconds": {"select": 0.004, ...}, "hardware": "this-machine"}

``stage_seconds`` are per decode step (runtime stage names: select, gather, copy, scatter, attend, insert,
other). Extra keys are kept; ``page_reuse_rate`` (measured fraction of selected pages already resident), when
present, replaces the hit model's page hit rate for that run (the hit rate is an input, not a prediction).

Protocol (docs/simulator_anchors.md, Validation protocol): the runs are split into a calibration set and a held-out set (``--holdout``:
the smaller half of the contexts, the smallest thread count, or a seeded third). Predictions come from the
calibration profile alone ("raw"); then one factor per stage (sum measured / sum predicted) and one for the
prefill part of TT2T are fitted on the calibration runs ("corrected"). Both are scored on the held-out runs
only: MAPE and signed bias (MPE) of TPOT, TT2T, TTFT and each stage, and Kendall's tau between predicted and
measured TPOT over the held-out configurations. Targets: MAPE <= 15 %, |bias| <= 5 %, tau >= 0.8.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError, InputError
from icecache.core.report import json_objects
from icecache.sim.config import SimConfig
from icecache.sim.hitrate import HitModel, HitStats, PriorHitModel, is_trace_path, load_hit_model, open_trace
from icecache.sim.model import SimResult, simulate
from icecache.sim.simulator import Simulator

RUNTIME_STAGES: tuple[str, ...] = ("select", "gather", "copy", "scatter", "attend", "insert", "other")
#: Simulator stages summed into each runtime stage. The runtime's timers (its `StageTimer`)
#: cover only the sparse layers' own work: select (the pager queries on the caller's thread), gather / copy /
#: scatter / other (inside `BulkLoader.load`; "other" is its residency bookkeeping), attend (SDPA over the
#: layer's device buffer) and insert (the synchronous window insert of `_decode_append`). Projections, MLP, LM
#: head and the attention of dense and sliding layers (simulator stages compute and dense_attend) and the
#: prefetched inserts on the worker pool (prefetch) are in no runtime stage, only in TPOT.
STAGE_MAP: dict[str, tuple[str, ...]] = {s: (s,) for s in RUNTIME_STAGES}
REQUIRED: tuple[str, ...] = ("variant", "model", "context", "budget", "page_size", "threads", "new_tokens", "tpot_s",
                             "tt2t_s", "ttft_s", "stage_seconds", "hardware")
TARGETS = {"mape": 0.15, "abs_bias": 0.05, "kendall_tau": 0.8}


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run (see the module docstring for the fields); ``extra`` keeps any other keys."""

    variant: str
    model: str
    context: int
    budget: int
    page_size: int
    threads: int
    new_tokens: int
    tpot_s: float
    tt2t_s: float
    ttft_s: float
    stage_seconds: dict[str, float]
    hardware: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "") -> MeasuredRun:
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise InputError(f"measured run {where}lacks {missing}")
        for k in ("tpot_s", "tt2t_s", "ttft_s"):
            if not isinstance(d[k], (int, float)) or not d[k] > 0:
                raise InputError(f"measured run {where}{k} must be a number > 0, got {d[k]!r}")
        try:
            return cls(
                variant=str(d["variant"]), model=str(d["model"]), context=int(d["context"]), budget=int(d["budget"]),
                page_size=int(d["page_size"]), threads=int(d["threads"]), new_tokens=int(d["new_tokens"]),
                tpot_s=float(d["tpot_s"]), tt2t_s=float(d["tt2t_s"]), ttft_s=float(d["ttft_s"]),
                stage_seconds={str(k): float(v) for k, v in dict(d["stage_seconds"] or {}).items()},
                hardware=str(d["hardware"]), extra={k: v for k, v in d.items() if k not in REQUIRED},
            )
        except (TypeError, ValueError) as exc:
            raise InputError(f"measured run {where}has a malformed field ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in REQUIRED}
        d.update(self.extra)
        return d

    def config(self, **overrides: Any) -> SimConfig:
        """The `SimConfig` that reproduces this run (``reuse_every``/``dense_layers``/``sink``/``window`` from
        ``extra`` when present; ``inserts`` from the run's ``stats["inserts"]``, where the runtime ran them)."""
        kw: dict[str, Any] = dict(
            model=self.model, hardware=self.hardware, variant=self.variant, context=self.context,
            budget=min(self.budget, self.context), page_size=self.page_size, threads=self.threads, new_tokens=self.new_tokens,
        )
        for key in ("reuse_every", "dense_layers", "sink", "window", "pager", "trace"):
            if key in self.extra:
                v = self.extra[key]
                # the measured runs' files call the pager "pager"; SimConfig calls it "index" (IceCacheConfig's name)
                kw["index" if key == "pager" else key] = tuple(v) if key == "dense_layers" and isinstance(v, list) else v
        ran = (self.extra.get("stats") or {}).get("inserts")
        if ran in ("background", "inline"):
            kw["inserts"] = ran
        kw.update(overrides)
        return SimConfig(**kw)


def drift_note(runs: Sequence[MeasuredRun]) -> str | None:
    """A line saying the runs were rescaled for the machine's drift (``repeats_drift_factors``, written by
    ``measure_runs.py --rescale-drift``) and by how much; None for raw runs."""
    factors = sorted(f[1] for r in runs for f in r.extra.get("repeats_drift_factors", []))
    if not factors:
        return None
    return (f"runs rescaled to the session's median speed probe (decode factors {factors[0]:.2f}-{factors[-1]:.2f}, "
            f"median {statistics.median(factors):.2f}, over {len(factors)} repeats; raw timings in the raw runs file)")


def read_runs(path: str | Path) -> list[MeasuredRun]:
    """Read measured runs (JSON lines; blank lines skipped)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no measured runs at {p} (experiments/sim/measure_runs.py writes them)")
    runs = []
    for line_no, d in json_objects(p.read_text().splitlines(), f"measured runs {p.name}"):
        runs.append(MeasuredRun.from_dict(d, f"{p.name}:{line_no} "))
    if not runs:
        raise ConfigError(f"{p} holds no runs")
    return runs


@dataclass(frozen=True)
class _RunHit:
    """A hit model whose page hit rate is a measured value (fill and budget use from ``base``)."""

    base: Any
    rate: float

    def predict(self, variant: str, budget: int, page_size: int, context: int, notes: list[str] | None = None) -> HitStats:
        hs = self.base.predict(variant, budget, page_size, context, notes)
        return dataclasses.replace(hs, page_hit_rate=min(max(self.rate, 0.0), 1.0), source="measured page_reuse_rate")


@dataclass(frozen=True)
class Prediction:
    """What the simulator says about one run (stages in the runtime's names, per step)."""

    tpot_s: float
    tt2t_s: float
    ttft_s: float
    stages: dict[str, float]
    bytes_per_step: float = float("nan")


def measured_bytes_per_step(run: MeasuredRun) -> float | None:
    """Bytes copied host -> device per decode step, from the run's stats (None when not recorded)."""
    st = run.extra.get("stats") or {}
    if "bytes_copied" in st and st.get("steps"):
        return float(st["bytes_copied"]) / float(st["steps"])
    return None


def runtime_stages(res: SimResult) -> dict[str, float]:
    """Simulator stages summed into the runtime's stage names (`STAGE_MAP`), as the runtime's timers would read
    them (`SimResult.stage_timed`: waits for a CPU held by background work included)."""
    src = res.stage_timed or res.stages
    return {k: sum(src.get(s, 0.0) for s in v) for k, v in STAGE_MAP.items()}


def run_key(d: dict[str, Any]) -> tuple[str, int, int, int, int]:
    """(variant, context, budget, page size, threads) of a run or of a trace's meta."""
    return (str(d.get("variant")), int(d.get("context", -1)), int(d.get("budget", -1)), int(d.get("page_size", -1)), int(d.get("threads", -1)))


def _trace_meta(p: Path) -> dict[str, Any] | None:
    """The meta line of the trace file ``p`` (None without one); `ConfigError`/`InputError` when unreadable."""
    if not p.is_file():
        raise ConfigError(f"no trace file at {p}")
    try:
        with open_trace(p) as fh:
            first = json.loads(fh.readline() or "{}")
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the trace {p} ({exc})") from None
    return first["meta"] if isinstance(first, dict) and isinstance(first.get("meta"), dict) else None


def _trace_key(p: Path) -> tuple[str, int, int, int, int] | None:
    meta = _trace_meta(p)
    return None if meta is None else run_key(meta)


def traced_keys(paths: Sequence[str | Path]) -> set[tuple[str, int, int, int, int]]:
    """`run_key` of every trace file's meta line among ``paths`` (``.jsonl``): the runs that recorded a trace."""
    keys = set()
    for p in paths:
        p = Path(p)
        if not is_trace_path(p) or not p.is_file():
            continue
        key = _trace_key(p)
        if key is not None:
            keys.add(key)
    return keys


def predict_runs(runs: Sequence[MeasuredRun], sim: Simulator, hit: HitModel | None = None,
                 traced: set[tuple[str, int, int, int, int]] | None = None) -> list[Prediction]:
    """Simulate every run's configuration (``sim``: `icecache.sim.simulator.Simulator`). A run recorded a selection
    trace when its row says so (``trace``) or its `run_key` is in ``traced``."""
    out = []
    base = hit or sim.hit or PriorHitModel()
    for r in runs:
        rate = r.extra.get("page_reuse_rate", (r.extra.get("stats") or {}).get("page_reuse_rate"))
        model = _RunHit(base, float(rate)) if rate is not None else base
        over = {} if "trace" in r.extra or traced is None else {"trace": run_key(r.to_dict()) in traced and r.variant != "full"}
        res = simulate(r.config(**over), sim.costs(r.hardware), model)
        # the runtime's TPOT is (end - TTFT) / (new tokens - 1): it includes the first decode step
        out.append(Prediction(res.tpot_mean_s, res.tt2t_s, res.ttft_s, runtime_stages(res), res.bytes_per_step))
    return out


def split_runs(runs: Sequence[MeasuredRun], rule: str, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices of (calibration, held-out) runs under ``rule`` (context | threads | random | none)."""
    idx = list(range(len(runs)))
    if rule == "none":
        return [], idx
    if rule == "context":
        ctx = sorted({r.context for r in runs})
        cut = ctx[(len(ctx) - 1) // 2] if len(ctx) > 1 else math.inf
        cal = [i for i in idx if runs[i].context <= cut]
    elif rule == "threads":
        low = min(r.threads for r in runs)
        cal = [i for i in idx if runs[i].threads == low]
        if len(cal) == len(idx):
            cal = []
    elif rule == "random":
        rng = random.Random(seed)
        cal = sorted(rng.sample(idx, max(1, len(idx) // 3))) if len(idx) > 1 else []
    else:
        raise ConfigError(f"unknown holdout rule {rule!r}; known: context, threads, random, none")
    test = [i for i in idx if i not in set(cal)]
    if not test:
        raise ConfigError(f"holdout rule {rule!r} leaves no runs to score")
    return cal, test


@dataclass(frozen=True)
class Corrections:
    """Factors (measured / predicted) fitted on calibration runs: per runtime stage; per variant for the untimed
    rest of a decode step (the model's own compute, dense layers, per-layer runtime overhead: TPOT minus the
    timed stages); and for the prefill."""

    stage_factors: dict[str, float]
    prefill_factor: float = 1.0
    rest_factors: dict[str, float] = field(default_factory=dict)

    def apply(self, p: Prediction, variant: str | None = None) -> Prediction:
        st = {k: v * self.stage_factors.get(k, 1.0) for k, v in p.stages.items()}
        rest = max(p.tpot_s - sum(p.stages.values()), 0.0)
        tpot = p.tpot_s + sum(st[k] - p.stages[k] for k in st) + rest * (self.rest_factors.get(variant, 1.0) - 1.0)
        pre = max(p.tt2t_s - p.tpot_s, 0.0) * self.prefill_factor
        return Prediction(tpot, pre + tpot, p.ttft_s * self.prefill_factor, st, p.bytes_per_step)


def fit_corrections(preds: Sequence[Prediction], runs: Sequence[MeasuredRun], lo: float = 0.05, hi: float = 20.0) -> Corrections:
    """Ratio-of-sums factors over the given (calibration) runs, clamped to ``[lo, hi]``; 1 where undefined.
    A variant's rest factor counts only runs that report every stage the prediction has (full attention: none)."""
    clamp = lambda num, den: min(max(num / den, lo), hi) if den > 0 and num > 0 else 1.0
    factors = {}
    for s in RUNTIME_STAGES:
        num = sum(r.stage_seconds[s] for p, r in zip(preds, runs) if s in r.stage_seconds and p.stages.get(s, 0) > 0)
        den = sum(p.stages[s] for p, r in zip(preds, runs) if s in r.stage_seconds and p.stages.get(s, 0) > 0)
        factors[s] = clamp(num, den)
    rest: dict[str, float] = {}
    for v in sorted({r.variant for r in runs}):
        pairs = [(p, r) for p, r in zip(preds, runs)
                 if r.variant == v and all(k in r.stage_seconds for k, x in p.stages.items() if x > 0)]
        num = sum(max(r.tpot_s - sum(r.stage_seconds.values()), 0.0) for _, r in pairs)
        den = sum(max(p.tpot_s - sum(p.stages.values()), 0.0) for p, _ in pairs)
        rest[v] = clamp(num, den)
    num = sum(max(r.tt2t_s - r.tpot_s, 0.0) for r in runs)
    den = sum(max(p.tt2t_s - p.tpot_s, 0.0) for p in preds)
    return Corrections(factors, clamp(num, den), rest)


def error_stats(pred: Sequence[float], meas: Sequence[float]) -> dict[str, float]:
    """MAPE and signed bias (MPE) of ``pred`` against ``meas`` (fractions), over pairs with meas > 0."""
    pairs = [(p, m) for p, m in zip(pred, meas) if m > 0 and math.isfinite(p)]
    if not pairs:
        return {"mape": math.nan, "bias": math.nan, "n": 0}
    rel = [(p - m) / m for p, m in pairs]
    return {"mape": sum(abs(x) for x in rel) / len(rel), "bias": sum(rel) / len(rel), "n": len(rel)}


def kendall_tau(pred: Sequence[float], meas: Sequence[float]) -> float:
    """Kendall's tau-b between two rankings (NaN with fewer than 3 points)."""
    if len(pred) < 3:
        return math.nan
    from scipy.stats import kendalltau

    tau = kendalltau(pred, meas).statistic
    return float(tau)


def repeat_noise(runs: Sequence[MeasuredRun], key: str = "tpot_s") -> float:
    """Median over runs of the relative range of their repeats (``extra["repeats_<key>"]``): how far two
    measurements of the same configuration lie apart here. NaN when no run lists two or more repeats."""
    rel = []
    for r in runs:
        xs = [float(x) for x in r.extra.get(f"repeats_{key}", []) if x]
        if len(xs) >= 2:
            rel.append((max(xs) - min(xs)) / statistics.median(xs))
    return statistics.median(rel) if rel else math.nan


def resolved_tau(pred: Sequence[float], meas: Sequence[float], noise: float, k: float = 2.0) -> tuple[float, int]:
    """Kendall's tau over the pairs the measurement can order: those whose measured values differ by more than
    ``k`` x ``noise`` (relative to their mean). Returns (tau, number of such pairs); a pair the prediction ties
    counts as neither concordant nor discordant. NaN (and 0) when ``noise`` is NaN or no pair qualifies."""
    if not math.isfinite(noise):
        return math.nan, 0
    conc = disc = pairs = 0
    for i in range(len(meas)):
        for j in range(i + 1, len(meas)):
            dm = meas[i] - meas[j]
            if abs(dm) <= k * noise * (meas[i] + meas[j]) / 2:
                continue
            pairs += 1
            dp = pred[i] - pred[j]
            if dp * dm > 0:
                conc += 1
            elif dp * dm < 0:
                disc += 1
    return ((conc - disc) / pairs if pairs else math.nan), pairs


@dataclass
class ValidationReport:
    """Errors of raw and corrected predictions on the held-out runs."""

    rule: str
    n_calibration: int
    n_test: int
    corrections: Corrections
    raw: dict[str, dict[str, float]]
    corrected: dict[str, dict[str, float]]
    tau_raw: float
    tau_corrected: float
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    #: relative repeat-to-repeat TPOT range (median over scored runs) and Kendall's tau over the pairs whose
    #: measured TPOTs differ by more than twice that (see `resolved_tau`); NaN without repeats
    tpot_noise: float = math.nan
    tau_resolved_raw: float = math.nan
    tau_resolved_corrected: float = math.nan
    resolved_pairs: int = 0

    def passes(self, which: str = "corrected") -> dict[str, bool]:
        m = getattr(self, which)
        tau = self.tau_corrected if which == "corrected" else self.tau_raw
        out = {}
        for k in ("tpot", "tt2t"):
            out[f"{k} MAPE <= 15%"] = m[k]["mape"] <= TARGETS["mape"]
            out[f"{k} |bias| <= 5%"] = abs(m[k]["bias"]) <= TARGETS["abs_bias"]
        out["Kendall tau >= 0.8"] = tau >= TARGETS["kendall_tau"]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["passes_corrected"] = self.passes("corrected")
        d["passes_raw"] = self.passes("raw")
        return d

    def to_markdown(self) -> str:
        def pct(x: float) -> str:
            return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:+.1f}%"

        lines = ["# Simulator validation against measured runs", "",
                 f"Hold-out rule `{self.rule}`: {self.n_calibration} calibration runs, {self.n_test} scored runs.", ""]
        lines += [f"- {n}" for n in self.notes] + ([""] if self.notes else [])
        lines += [
                 "| metric | raw MAPE | raw bias | corrected MAPE | corrected bias | n |", "|---|---:|---:|---:|---:|---:|"]
        for k in self.raw:
            r, c = self.raw[k], self.corrected[k]
            lines.append(f"| {k} | {pct(r['mape']).lstrip('+')} | {pct(r['bias'])} | {pct(c['mape']).lstrip('+')} | {pct(c['bias'])} | {r['n']} |")
        n_pairs = self.n_test * (self.n_test - 1) // 2
        lines += ["", f"Kendall tau (TPOT ranking of scored configurations): raw {self.tau_raw:.3f}, corrected {self.tau_corrected:.3f}", ""]
        if math.isfinite(self.tpot_noise):
            lines += [f"Measurement noise: two measurements of one configuration differ by {self.tpot_noise * 100:.1f}% (median relative "
                      f"range of TPOT over repeats). Over the {self.resolved_pairs} of {n_pairs} pairs whose measured TPOTs differ by "
                      f"more than twice that, Kendall tau is raw {self.tau_resolved_raw:.3f}, corrected {self.tau_resolved_corrected:.3f} "
                      "(the target is stated on the plain tau above).", ""]
        lines += [
                  "Stage corrections (measured / predicted on the calibration runs): "
                  + ", ".join(f"{k} x{v:.2f}" for k, v in self.corrections.stage_factors.items())
                  + f"; prefill x{self.corrections.prefill_factor:.2f}; rest of the decode step (TPOT minus the timed stages) "
                  + ", ".join(f"{k} x{v:.2f}" for k, v in self.corrections.rest_factors.items()), ""]
        for which in ("raw", "corrected"):
            lines += [f"Targets ({which}): " + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in self.passes(which).items()), ""]
        lines += ["Per variant (scored runs): TPOT / TT2T MAPE and bias, raw -> corrected", "",
                  "| variant | n | TPOT MAPE | TPOT bias | TT2T MAPE | TT2T bias |", "|---|---:|---:|---:|---:|---:|"]
        for v in sorted({r["variant"] for r in self.rows}):
            rs = [r for r in self.rows if r["variant"] == v]
            cells = []
            for m in ("tpot", "tt2t"):
                a = error_stats([r[f"{m}_raw"] for r in rs], [r[f"{m}_meas"] for r in rs])
                b = error_stats([r[f"{m}_corr"] for r in rs], [r[f"{m}_meas"] for r in rs])
                cells += [f"{pct(a['mape']).lstrip('+')} -> {pct(b['mape']).lstrip('+')}", f"{pct(a['bias'])} -> {pct(b['bias'])}"]
            lines.append(f"| {v} | {len(rs)} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += ["", "| variant | context | budget | page | threads | TPOT meas ms | raw | corrected | TT2T meas s | raw | corrected |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in self.rows:
            lines.append(
                f"| {r['variant']} | {r['context']} | {r['budget']} | {r['page_size']} | {r['threads']} | {r['tpot_meas'] * 1e3:.1f} | "
                f"{r['tpot_raw'] * 1e3:.1f} | {r['tpot_corr'] * 1e3:.1f} | {r['tt2t_meas']:.2f} | {r['tt2t_raw']:.2f} | {r['tt2t_corr']:.2f} |"
            )
        return "\n".join(lines) + "\n"


def validate(runs: Sequence[MeasuredRun], sim: Simulator, rule: str = "context", seed: int = 0, hit: HitModel | None = None,
             traced: set[tuple[str, int, int, int, int]] | None = None) -> ValidationReport:
    """Predict ``runs``, fit corrections on the calibration split, score the held-out split."""
    preds = predict_runs(runs, sim, hit, traced)
    cal, test = split_runs(runs, rule, seed)
    corr = fit_corrections([preds[i] for i in cal], [runs[i] for i in cal]) if cal else Corrections({s: 1.0 for s in RUNTIME_STAGES})
    fixed = [corr.apply(p, r.variant) for p, r in zip(preds, runs)]

    def metrics(ps: Sequence[Prediction]) -> dict[str, dict[str, float]]:
        out = {
            "tpot": error_stats([ps[i].tpot_s for i in test], [runs[i].tpot_s for i in test]),
            "tt2t": error_stats([ps[i].tt2t_s for i in test], [runs[i].tt2t_s for i in test]),
            "ttft": error_stats([ps[i].ttft_s for i in test], [runs[i].ttft_s for i in test]),
        }
        for s in RUNTIME_STAGES:
            have = [i for i in test if s in runs[i].stage_seconds]
            out[f"stage {s}"] = error_stats([ps[i].stages[s] for i in have], [runs[i].stage_seconds[s] for i in have])
        have = [i for i in test if measured_bytes_per_step(runs[i])]
        out["bytes per step"] = error_stats([ps[i].bytes_per_step for i in have], [measured_bytes_per_step(runs[i]) or 0.0 for i in have])
        return out

    rows = [
        dict(variant=runs[i].variant, context=runs[i].context, budget=runs[i].budget, page_size=runs[i].page_size,
             threads=runs[i].threads, tpot_meas=runs[i].tpot_s, tpot_raw=preds[i].tpot_s, tpot_corr=fixed[i].tpot_s,
             tt2t_meas=runs[i].tt2t_s, tt2t_raw=preds[i].tt2t_s, tt2t_corr=fixed[i].tt2t_s)
        for i in test
    ]
    noise = repeat_noise([runs[i] for i in test])
    meas = [runs[i].tpot_s for i in test]
    res_raw, n_res = resolved_tau([preds[i].tpot_s for i in test], meas, noise)
    res_corr, _ = resolved_tau([fixed[i].tpot_s for i in test], meas, noise)
    return ValidationReport(
        tpot_noise=noise, tau_resolved_raw=res_raw, tau_resolved_corrected=res_corr, resolved_pairs=n_res,
        rule=rule, n_calibration=len(cal), n_test=len(test), corrections=corr, raw=metrics(preds), corrected=metrics(fixed),
        tau_raw=kendall_tau([preds[i].tpot_s for i in test], [runs[i].tpot_s for i in test]),
        tau_corrected=kendall_tau([fixed[i].tpot_s for i in test], [runs[i].tpot_s for i in test]),
        rows=rows,
    )


def synthetic_runs(
    configs: Sequence[SimConfig], sim: Simulator, *, stage_factors: dict[str, float] | None = None, prefill_factor: float = 1.0,
    noise: float = 0.0, seed: int = 0, rest_factors: dict[str, float] | None = None,
) -> list[MeasuredRun]:
    """Measured runs made from the simulator itself with known distortions (for testing `validate`).

    Each runtime stage is multiplied by ``stage_factors[stage]`` and by log-normal noise of relative size
    ``noise``; TPOT is the simulated one (`SimResult.tpot_mean_s`, as the runtime defines it) plus the
    stages' changes and the rest of the step (TPOT minus the stages) times ``rest_factors[variant]``; TT2T the
    distorted prefill plus TPOT.
    """
    rng = random.Random(seed)
    out = []
    for cfg in configs:
        res = sim.run(cfg)
        st0 = runtime_stages(res)
        st = {k: v * (stage_factors or {}).get(k, 1.0) * math.exp(rng.gauss(0.0, noise)) for k, v in st0.items()}
        tpot = res.tpot_mean_s + sum(st[k] - st0[k] for k in st)
        tpot += max(res.tpot_mean_s - sum(st0.values()), 0.0) * ((rest_factors or {}).get(cfg.variant, 1.0) - 1.0)
        pre = (res.tt2t_s - res.tpot_mean_s) * prefill_factor * math.exp(rng.gauss(0.0, noise))
        out.append(MeasuredRun(
            variant=cfg.variant, model=cfg.model, context=cfg.context, budget=cfg.budget, page_size=cfg.page_size,
            threads=cfg.threads, new_tokens=cfg.new_tokens, tpot_s=tpot, tt2t_s=pre + tpot,
            ttft_s=res.ttft_s * prefill_factor, stage_seconds=st, hardware=cfg.hardware,
            extra={"synthetic": True, "reuse_every": cfg.reuse_every, "dense_layers": list(cfg.dense_layers),
                   "stats": {"steps": cfg.new_tokens - 1 or 1, "bytes_copied": res.bytes_per_step * (cfg.new_tokens - 1 or 1)}},
        ))
    return out


def validation_hit_model(runs: Sequence[MeasuredRun], hit_paths: Sequence[str | Path], holdout: str, extrapolation: str
                         ) -> tuple[HitModel | None, str, set[tuple[str, int, int, int, int]]]:
    """The hit model of a validation from ``--hit`` files, what to say about it, and the `run_key` of every run
    that recorded a trace.

    Traces among ``hit_paths`` are fitted only where they belong to calibration runs of the ``holdout`` split (all
    of them when none does), so no number of a scored run enters a prediction; each run's measured page reuse
    still replaces the hit rate (`predict_runs`)."""
    paths = [Path(p) for p in hit_paths]
    traces = [p for p in paths if is_trace_path(p)]
    if not traces:
        return (load_hit_model(paths, extrapolation) if paths else None), "", set()
    cal, _ = split_runs(runs, holdout)
    cal_keys = {run_key(runs[i].to_dict()) for i in cal}
    keep = [p for p in traces if _trace_key(p) in cal_keys] or traces
    note = (f"hit model: fitted to {len(keep)} of {len(traces)} traces" +
            (" (those of the calibration runs)" if len(keep) < len(traces) else " (no calibration run has a trace: all used)"))
    return load_hit_model(keep + [p for p in paths if not is_trace_path(p)], extrapolation), note, traced_keys(traces)


def recorded_command(argv: Sequence[str], runs_arg: str | None = None) -> str:
    """The command a validation report records: ``argv`` with many trace files (a shell glob) named by their
    folders and suffix instead of file by file (``runs_arg``, the ``--runs`` file, is kept as given)."""
    argv = list(argv)
    shown = [a for a in argv if not is_trace_path(a) or a == runs_arg]
    if len(shown) < len(argv):
        globs = sorted({f"{Path(a).parent}/*{''.join(Path(a).suffixes[-2:])}" for a in argv if is_trace_path(a) and a != runs_arg})
        at = shown.index("--hit") + 1 if "--hit" in shown else len(shown)
        shown[at:at] = globs
    return "python -m icecache.sim " + " ".join(a if "*" in a else shlex.quote(a) for a in shown)


def write_report(report: ValidationReport, out: str | Path) -> tuple[Path, Path]:
    """``out`` (Markdown) and the JSON next to it (same name, ``.json``)."""
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(report.to_markdown())
    p.with_suffix(".json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    return p, p.with_suffix(".json")
