"""Sweeps: expand a grid of configurations, simulate them on a process pool (or Ray), write CSV/Markdown/plots.

    python -m icecache.sim sweep --hardware a100,h100 --model llama-3.1-8b --context 8k..256k \\
        --budgets 64,128,256 --page-sizes 8,16,32 --threads 8,16,64 --variants full,icecache,icecache-r,quest \\
        --out results/sweep

``full`` does not depend on budget, page size or threads, so it is simulated once per (hardware, model,
context). Each worker receives the profile's predictors (not its raw samples) with its chunk; nothing is
shared between processes. The optional Ray backend (``--backend ray``, needs ``pip install ray``) runs the
same chunks as Ray tasks on the cluster named by ``RAY_ADDRESS`` (or a local one).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.core.report import write_csv
from icecache.core.spec import parse_tokens
from icecache.sim.config import VARIANTS, SimConfig
from icecache.sim.crossover import crossovers, describe_crossover
from icecache.sim.engine import STAGES
from icecache.sim.hardware import canonical_hardware
from icecache.sim.hitrate import HitModel
from icecache.sim.inputs import format_dense_layers
from icecache.sim.predictors import ExtrapolationWarning
from icecache.sim.profile import CalibrationProfile
from icecache.sim.shapes import get_shape
from icecache.sim.simulator import Simulator

__all__ = ["parse_contexts", "SweepSpec", "run_configs", "default_workers", "reference_crossovers", "summary_markdown",
           "write_plots", "write_results"]


def parse_contexts(text: str) -> list[int]:
    """``"8k..256k"`` (doubling), ``"8k..256k:12"`` (12 log-spaced points), or ``"8k,36k,100k"``."""
    t = str(text).strip()
    if ".." in t:
        rng, _, count = t.partition(":")
        lo_s, hi_s = rng.split("..", 1)
        lo, hi = parse_tokens(lo_s), parse_tokens(hi_s)
        if lo < 1 or hi < lo:
            raise ConfigError(f"context range {text!r} must have 1 <= low <= high")
        if count:
            try:
                k = int(count)
            except ValueError:
                raise ConfigError(f"context range {text!r}: the count after ':' must be an integer") from None
            if k < 2:
                raise ConfigError(f"context range {text!r}: need at least 2 points")
            pts = [round(lo * (hi / lo) ** (i / (k - 1))) for i in range(k)]
        else:
            pts, c = [], lo
            while c <= hi:
                pts.append(c)
                c *= 2
        return sorted(set(pts))
    out = [parse_tokens(x) for x in t.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise ConfigError(f"contexts {text!r} must list token counts >= 1")
    return out


@dataclass(frozen=True)
class SweepSpec:
    """The grid: every combination of the lists (``full`` collapses budget/page size/threads)."""

    hardware: tuple[str, ...]
    models: tuple[str, ...]
    contexts: tuple[int, ...]
    budgets: tuple[int, ...]
    page_sizes: tuple[int, ...]
    threads: tuple[int, ...]
    variants: tuple[str, ...]
    reuse_every: int = 1
    impl: str = "runtime"
    dense_layers: tuple[int, ...] = (0, 1)

    @classmethod
    def from_strings(cls, *, hardware: str, models: str, contexts: str, budgets: str, page_sizes: str, threads: str,
                     variants: str, reuse_every: int = 1, impl: str = "runtime", dense_layers: Sequence[int] = (0, 1)) -> SweepSpec:
        def ints(s: str) -> tuple[int, ...]:
            return tuple(parse_tokens(x) for x in str(s).split(",") if x.strip())

        def names(s: str) -> tuple[str, ...]:
            return tuple(x.strip() for x in str(s).split(",") if x.strip())

        spec = cls(
            hardware=tuple(canonical_hardware(h) for h in names(hardware)),
            models=tuple(get_shape(m).name for m in names(models)),
            contexts=tuple(parse_contexts(contexts)),
            budgets=ints(budgets), page_sizes=ints(page_sizes), threads=ints(threads), variants=names(variants),
            reuse_every=reuse_every, impl=impl, dense_layers=tuple(dense_layers),
        )
        for v in spec.variants:
            if v not in VARIANTS:
                raise UnknownNameError(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
        return spec

    def reference_point(self) -> tuple[int, int, int]:
        """(budget, page size, threads) of the summary's tables and crossovers: 256 and 16 when swept (else the
        middle value), the most threads."""
        return _ref(self.budgets, 256), _ref(self.page_sizes, 16), max(self.threads)

    def configs(self) -> list[SimConfig]:
        """Every configuration of the grid (validated)."""
        out: list[SimConfig] = []
        for hw in self.hardware:
            for m in self.models:
                for n in self.contexts:
                    for v in self.variants:
                        common = dict(reuse_every=self.reuse_every, impl=self.impl, dense_layers=self.dense_layers)
                        if v == "full":
                            out.append(SimConfig(m, hw, v, n, budget=min(self.budgets[0], n), page_size=self.page_sizes[0],
                                                 threads=self.threads[0], **common))
                            continue
                        for b in self.budgets:
                            if b > n:
                                continue
                            for p in self.page_sizes:
                                for t in self.threads:
                                    out.append(SimConfig(m, hw, v, n, budget=b, page_size=p, threads=t, **common))
        return out


def _lean(profile: CalibrationProfile | None) -> CalibrationProfile | None:
    """The profile without raw samples (what workers need)."""
    return None if profile is None else profile.lean()


def _run_chunk(job: tuple[CalibrationProfile | None, HitModel | None, str, list[SimConfig], bool]) -> list[dict[str, Any]]:
    profile, hit, extrapolation, configs, with_prefill = job
    warnings.simplefilter("ignore", ExtrapolationWarning)  # every row carries its own notes
    sim = Simulator(profile, hit, extrapolation)
    return [sim.run(c, with_prefill=with_prefill).to_row() for c in configs]


def run_configs(
    configs: Sequence[SimConfig], profile: CalibrationProfile | None, hit: HitModel | None = None, *,
    extrapolation: str = "allow", workers: int = 0, backend: str = "process", with_prefill: bool = True,
) -> list[dict[str, Any]]:
    """Simulate ``configs``; rows in the order given.

    ``backend``: ``serial`` (this process), ``process`` (a local process pool of ``workers``, 0 = one per
    CPU), or ``ray`` (optional dependency, imported only here).
    """
    configs = list(configs)
    if workers < 0:
        raise ConfigError(f"workers must be >= 0 (0: one per CPU), got {workers}")
    lean = _lean(profile)
    if backend == "serial" or len(configs) < 64:
        return _run_chunk((lean, hit, extrapolation, configs, with_prefill))
    n_workers = workers or default_workers()
    n_chunks = max(1, min(len(configs), n_workers * 4))
    size = math.ceil(len(configs) / n_chunks)
    chunks = [(lean, hit, extrapolation, configs[i : i + size], with_prefill) for i in range(0, len(configs), size)]
    if backend == "ray":
        try:
            import ray  # optional extra
        except ImportError:
            raise ConfigError("the ray backend needs Ray: pip install ray (optional; --backend process needs nothing)") from None
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
        remote = ray.remote(_run_chunk)
        parts = ray.get([remote.remote(c) for c in chunks])
    elif backend == "process":
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx) as ex:
            parts = list(ex.map(_run_chunk, chunks))
    else:
        raise ConfigError(f"unknown backend {backend!r}; known: serial, process, ray")
    return [row for part in parts for row in part]


def default_workers() -> int:
    """Worker processes of a sweep by default: one per usable CPU."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _ref(values: Sequence[int], prefer: int) -> int:
    return prefer if prefer in values else sorted(values)[len(values) // 2]


def reference_crossovers(rows: Sequence[dict[str, Any]], spec: SweepSpec) -> list[dict[str, Any]]:
    """`crossovers` at the spec's `SweepSpec.reference_point`, each with its wording (``text``, `describe_crossover`),
    as both the summary and the console print them."""
    b, p, t = spec.reference_point()
    return [dict(x, text=describe_crossover(x["crossover_tokens"])) for x in crossovers(rows)
            if x["budget"] == b and x["page_size"] == p and x["threads"] == t]


def write_plots(rows: Sequence[dict[str, Any]], spec: SweepSpec, out_dir: Path) -> list[Path]:
    """TPOT vs context (with crossovers), per-stage breakdown bars, page hit rate and bytes vs budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    b, p, t = spec.reference_point()
    pairs = [(h, m) for h in spec.hardware for m in spec.models]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.2), squeeze=False)
    xs = crossovers(rows)
    for ax, (h, m) in zip(axes[0], pairs):
        for v in spec.variants:
            rs = sorted((r for r in rows if r["hardware"] == h and r["model"] == m and r["variant"] == v
                         and (v == "full" or (r["budget"] == b and r["page_size"] == p and r["threads"] == t))),
                        key=lambda r: r["context"])
            if not rs:
                continue
            ax.plot([r["context"] / 1000 for r in rs], [r["tpot_s"] * 1e3 for r in rs], marker="o", ms=3, label=v)
            bad = [r for r in rs if not r["fits_device"]]
            if bad:
                ax.scatter([r["context"] / 1000 for r in bad], [r["tpot_s"] * 1e3 for r in bad], marker="x", color="k", zorder=5)
        colors = {line.get_label(): line.get_color() for line in ax.get_lines()}
        mine = [x for x in xs if (x["hardware"], x["model"], x["budget"], x["page_size"], x["threads"]) == (h, m, b, p, t)
                and math.isfinite(x["crossover_tokens"])]
        y0, y1 = ax.get_ylim()
        for i, x in enumerate(mine):
            c = colors.get(x["variant"], "gray")
            ax.axvline(x["crossover_tokens"] / 1000, ls=":", lw=1, color=c)
            ax.annotate(f"{x['variant']} = full at {x['crossover_tokens'] / 1000:.0f}k", (x["crossover_tokens"] / 1000, y1 - (0.06 + 0.07 * i) * (y1 - y0)),
                        fontsize=7, ha="left", color=c)
        ax.set_xscale("log")
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"{h} / {m}\nbudget {b}, page {p}, {t} threads; x = full KV does not fit", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "tpot_vs_context.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # per-stage breakdown at up to three contexts, first hardware/model
    h, m = pairs[0]
    ctxs = sorted(spec.contexts)
    pick = sorted({ctxs[0], ctxs[len(ctxs) // 2], ctxs[-1]})
    stages = STAGES
    fig, axes = plt.subplots(1, len(pick), figsize=(4.5 * len(pick), 4), squeeze=False)
    for ax, n in zip(axes[0], pick):
        bottoms = [0.0] * len(spec.variants)
        for s in stages:
            vals = []
            for v in spec.variants:
                r = next((r for r in rows if r["hardware"] == h and r["model"] == m and r["variant"] == v and r["context"] == n
                          and (v == "full" or (r["budget"] == b and r["page_size"] == p and r["threads"] == t))), None)
                vals.append(r[f"stage_{s}_s"] * 1e3 if r else 0.0)
            ax.bar(spec.variants, vals, bottom=bottoms, label=s)
            bottoms = [x + y for x, y in zip(bottoms, vals)]
        ax.set_title(f"{h} / {m}, {n / 1000:.0f}k tokens", fontsize=8)
        ax.set_ylabel("busy ms per step")
        ax.tick_params(axis="x", labelsize=7)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "stage_breakdown.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # page hit rate and bytes per step vs budget, one line per page size
    v = "icecache" if "icecache" in spec.variants else next((x for x in spec.variants if x != "full"), None)
    if v is not None:
        n = ctxs[len(ctxs) // 2]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for ps in spec.page_sizes:
            rs = sorted((r for r in rows if r["hardware"] == h and r["model"] == m and r["variant"] == v and r["context"] == n
                         and r["page_size"] == ps and r["threads"] == t), key=lambda r: r["budget"])
            a1.plot([r["budget"] for r in rs], [r["page_hit_rate"] for r in rs], marker="o", label=f"page {ps}")
            a2.plot([r["budget"] for r in rs], [r["bytes_per_step"] / 1e6 for r in rs], marker="o", label=f"page {ps}")
        src = next((r["hit_source"] for r in rows if r["variant"] == v), "")
        a1.set_title(f"{v}: page hit rate (resident from previous step)\n{src}", fontsize=8)
        a1.set_xlabel("budget (tokens)")
        a1.set_ylim(-0.02, 1.02)
        a2.set_title(f"{v}: bytes copied per step, {h} / {m}, {n / 1000:.0f}k", fontsize=8)
        a2.set_xlabel("budget (tokens)")
        a2.set_ylabel("MB per step")
        a1.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / "hit_rate_vs_budget.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def summary_markdown(rows: Sequence[dict[str, Any]], spec: SweepSpec, *, command: str, wall_s: float,
                     workers: int, backend: str, profile: CalibrationProfile | None, plots: Sequence[Path] = (),
                     loadavg: Sequence[float] | None = None, total_s: float | None = None) -> str:
    """The sweep summary: command and wall time, TPOT table, crossovers, breakdown, caveats (and the plots)."""
    b, p, t = spec.reference_point()
    lines = ["# IceCache simulator sweep", "", f"Command: `{command}`", "",
             f"{len(rows)} configurations simulated in **{wall_s:.1f} s** wall time ({backend} backend, {workers} workers"
             + (f"; 1-minute load average {loadavg[0]:.1f} at the start, the machine is shared" if loadavg else "") + ")"
             + (f"; {total_s:.1f} s with the CSV and plots." if total_s is not None else "."), ""]
    if profile is not None:
        lines += [f"Calibration profile: {profile.created}, {profile.machine.get('cpu_model')} "
                  f"({profile.machine.get('cpu_count')} CPUs), pagers measured: {', '.join(profile.pagers)}.", ""]
    srcs = sorted({r["hit_source"] for r in rows if r["hit_source"]})
    lines += [f"Page hit rate source: {'; '.join(srcs) or 'n/a'}.", ""]
    lines += [f"## TPOT (ms) vs context (budget {b}, page {p}, {t} threads)", ""]
    for h in spec.hardware:
        for m in spec.models:
            lines += [f"**{h} / {m}**", "", "| context | " + " | ".join(spec.variants) + " |", "|---:|" + "---:|" * len(spec.variants)]
            for n in spec.contexts:
                cells = []
                for v in spec.variants:
                    r = next((r for r in rows if r["hardware"] == h and r["model"] == m and r["variant"] == v and r["context"] == n
                              and (v == "full" or (r["budget"] == b and r["page_size"] == p and r["threads"] == t))), None)
                    cells.append("" if r is None else f"{r['tpot_s'] * 1e3:.1f}{'' if r['fits_device'] else ' (OOM)'}")
                lines.append(f"| {n / 1000:g}k | " + " | ".join(cells) + " |")
            lines.append("")
    xs = reference_crossovers(rows, spec)
    if xs:
        lines += ["## Crossover with full KV (context where the variant's TPOT drops below full KV's)", "",
                  "| hardware | model | variant | crossover (k tokens) |", "|---|---|---|---:|"]
        for x in xs:
            c = x["crossover_tokens"]
            txt = f"{c / 1000:.0f}" if math.isfinite(c) else x["text"]
            lines.append(f"| {x['hardware']} | {x['model']} | {x['variant']} | {txt} |")
        lines.append("")
    ext = sum(1 for r in rows if r["extrapolated"])
    scaled = sum(1 for r in rows if r["shape_scaled"])
    lines += ["## Caveats", "",
              f"- {ext} of {len(rows)} rows use a cost predictor or the hit model outside its measured / traced range "
              "(column `extrapolated`, details in `notes`).",
              f"- {scaled} rows scale host-side costs measured on the embedded model to another model's shape "
              "(queries per select x head width; column `shape_scaled`).",
              "- OOM: full KV plus weights exceed the device memory; its TPOT is what it would be if it fit.",
              f"- Implementation modelled: `{spec.impl}` (icecache.sim.model docstring); dense layers: {format_dense_layers(spec.dense_layers)}"
              + (f"; icecache-r selects every {spec.reuse_every} sparse layers." if "icecache-r" in spec.variants else "."),
              "- Busy times per stage can sum to more than TPOT where stages overlap (background inserts, the paper's "
              "icecache-r early loads).", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{q.stem}]({q.name})" for q in plots] + [""]
    return "\n".join(lines)


def write_results(rows: Sequence[dict[str, Any]], spec: SweepSpec, out_dir: str | Path, *, plots: bool, started: float | None = None,
                  **summary: Any) -> list[Path]:
    """``results.csv``, the plots (unless not ``plots``) and ``summary.md`` (`summary_markdown` with ``summary``'s
    keywords; ``total_s`` from ``started``, a `time.perf_counter` reading, when given) under ``out_dir``; returns
    the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(out / "results.csv", rows, float_format=".6g")
    figures = write_plots(rows, spec, out) if plots else []
    if started is not None:
        summary["total_s"] = time.perf_counter() - started
    md = out / "summary.md"
    md.write_text(summary_markdown(rows, spec, plots=figures, **summary))
    return [csv_path, md, *figures]
