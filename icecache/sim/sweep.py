"""Sweeps: expand a grid of configurations, simulate them on a process pool (or Ray), write CSV/Markdown/plots.

    python -m icecache.sim sweep --hardware a100,h100 --model llama-3.1-8b --context 8k..256k \\
        --budgets 64,128,256 --page-sizes 8,16,32 --threads 8,16,64 --variants full,icecache,icecache-r,quest

``full`` does not depend on budget, page size or threads, so it is simulated once per (hardware, model,
context). Each worker receives the profile's predictors (not its raw samples) with its chunk; nothing is
shared between processes. The optional Ray backend (``--backend ray``, needs ``pip install ray``) runs the
same chunks as Ray tasks on the cluster named by ``RAY_ADDRESS`` (or a local one).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from icecache.core.errors import ConfigError
from icecache.sim.costs import CalibrationProfile, ExtrapolationWarning, ProfileMismatchWarning
from icecache.sim.hardware import canonical_hardware, get_hardware, make_costs
from icecache.sim.hitrate import HitModel, PriorHitModel, load_hit_model
from icecache.sim.model import VARIANTS, SimConfig, SimResult, parse_tokens, simulate
from icecache.sim.shapes import get_shape


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
            k = int(count)
            if k < 2:
                raise ConfigError(f"context range {text!r}: need at least 2 points")
            pts = [round(lo * (hi / lo) ** (i / (k - 1))) for i in range(k)]
        else:
            pts, c = [], lo
            while c <= hi:
                pts.append(c)
                c *= 2
        return sorted(set(pts))
    return [parse_tokens(x) for x in t.split(",") if x.strip()]


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
    reuse: int = 4
    impl: str = "runtime"
    dense_layers: int = 2

    @classmethod
    def from_strings(cls, *, hardware: str, models: str, contexts: str, budgets: str, page_sizes: str, threads: str,
                     variants: str, reuse: int = 4, impl: str = "runtime", dense_layers: int = 2) -> "SweepSpec":
        def ints(s: str) -> tuple[int, ...]:
            return tuple(parse_tokens(x) for x in str(s).split(",") if x.strip())

        def names(s: str) -> tuple[str, ...]:
            return tuple(x.strip() for x in str(s).split(",") if x.strip())

        spec = cls(
            hardware=tuple(canonical_hardware(h) for h in names(hardware)),
            models=tuple(get_shape(m).name for m in names(models)),
            contexts=tuple(parse_contexts(contexts)),
            budgets=ints(budgets), page_sizes=ints(page_sizes), threads=ints(threads), variants=names(variants), reuse=reuse,
            impl=impl, dense_layers=dense_layers,
        )
        for v in spec.variants:
            if v not in VARIANTS:
                from icecache.core.errors import UnknownNameError

                raise UnknownNameError(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
        return spec

    def configs(self) -> list[SimConfig]:
        """Every configuration of the grid (validated)."""
        out: list[SimConfig] = []
        for hw in self.hardware:
            for m in self.models:
                for n in self.contexts:
                    for v in self.variants:
                        common = dict(reuse=self.reuse, impl=self.impl, dense_layers=self.dense_layers)
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


class Simulator:
    """Simulates configurations on any hardware with one calibration profile and hit model (costs cached)."""

    def __init__(self, profile: CalibrationProfile | None, hit: HitModel | None = None, extrapolation: str = "allow") -> None:
        self.profile = profile
        self.hit = hit or PriorHitModel()
        self.extrapolation = extrapolation
        self._costs: dict[str, Any] = {}

    def costs(self, hardware: str) -> Any:
        if hardware not in self._costs:
            hw = get_hardware(hardware, self.profile)
            self._costs[hardware] = make_costs(hw, self.profile, self.extrapolation)
        return self._costs[hardware]

    def run(self, cfg: SimConfig, fine: bool = False, with_prefill: bool = True) -> SimResult:
        return simulate(cfg, self.costs(cfg.hardware), self.hit, fine=fine, with_prefill=with_prefill)


def _lean(profile: CalibrationProfile | None) -> CalibrationProfile | None:
    """The profile without raw samples (what workers need)."""
    return None if profile is None else dataclasses.replace(profile, samples={})


def _run_chunk(job: tuple[Any, Any, str, list[SimConfig], bool]) -> list[dict[str, Any]]:
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
    lean = _lean(profile)
    if backend == "serial" or len(configs) < 64:
        return _run_chunk((lean, hit, extrapolation, configs, with_prefill))
    n_workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
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


# ------------------------------------------------------------------------------------------- crossover
def crossovers(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (hardware, model, variant, budget, page size, threads): the context where the variant's TPOT drops
    below full KV's, interpolated linearly between the two grid contexts around the sign change."""
    rows = list(rows)
    full = {(r["hardware"], r["model"], r["context"]): r["tpot_s"] for r in rows if r["variant"] == "full"}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["variant"] != "full":
            groups.setdefault((r["hardware"], r["model"], r["variant"], r["budget"], r["page_size"], r["threads"]), []).append(r)
    out = []
    for key, rs in sorted(groups.items()):
        pts = sorted((r["context"], full.get((key[0], key[1], r["context"]), math.nan) - r["tpot_s"]) for r in rs)
        pts = [p for p in pts if not math.isnan(p[1])]
        x = math.nan
        for (c0, d0), (c1, d1) in zip(pts, pts[1:]):
            if d0 < 0 <= d1:
                x = c0 + (c1 - c0) * (-d0) / (d1 - d0)
                break
        if pts and math.isnan(x) and pts[0][1] >= 0:
            x = -math.inf  # faster already at the smallest context
        elif pts and math.isnan(x) and all(d < 0 for _, d in pts):
            x = math.inf  # still slower at the largest context
        out.append(dict(zip(("hardware", "model", "variant", "budget", "page_size", "threads"), key), crossover_tokens=x))
    return out


def crossings(sim: Simulator, cfg: SimConfig, lo: int = 1_000, hi: int = 4_000_000, points: int = 48,
              rel_tol: float = 0.002) -> list[tuple[float, str]]:
    """Every context in ``[lo, hi]`` where ``cfg.variant`` and full KV swap places, as ``(tokens, direction)``
    with direction ``"faster"`` (the variant becomes faster than full KV) or ``"slower"``.

    A log-spaced scan of ``points`` contexts brackets each sign change of ``TPOT_full - TPOT_variant``; bisection
    then narrows it to ``rel_tol``. Changes between two scan points closer than the scan step can be missed.
    """

    def diff(n: int) -> float:
        c = cfg.replace(context=n, budget=min(cfg.budget, n))
        return sim.run(c.replace(variant="full"), with_prefill=False).tpot_s - sim.run(c, with_prefill=False).tpot_s

    grid = sorted({int(round(lo * (hi / lo) ** (i / (points - 1)))) for i in range(points)})
    vals = [diff(n) for n in grid]
    out = []
    for (a, da), (b, db) in zip(zip(grid, vals), zip(grid[1:], vals[1:])):
        if (da < 0) == (db < 0):
            continue
        x0, x1, d0 = a, b, da
        while x1 / x0 > 1 + rel_tol:
            mid = int(round(math.sqrt(x0 * x1)))
            dm = diff(mid)
            if (dm < 0) == (d0 < 0):
                x0, d0 = mid, dm
            else:
                x1 = mid
        out.append((float(x1), "faster" if da < 0 else "slower"))
    return out


def find_crossover(sim: Simulator, cfg: SimConfig, lo: int = 1_000, hi: int = 4_000_000, rel_tol: float = 0.002) -> float:
    """The first context where ``cfg.variant`` becomes faster than full KV (see `crossings`).

    Returns ``-inf`` when it is already faster at ``lo`` and ``inf`` when it never becomes faster up to ``hi``.
    """
    first = crossings(sim, cfg, lo, hi, rel_tol=rel_tol)
    sim_lo = cfg.replace(context=lo, budget=min(cfg.budget, lo))
    if sim.run(sim_lo.replace(variant="full"), with_prefill=False).tpot_s >= sim.run(sim_lo, with_prefill=False).tpot_s:
        return -math.inf
    faster = [x for x, d in first if d == "faster"]
    return faster[0] if faster else math.inf


@dataclass(frozen=True)
class SelectGrowth:
    """A cost model whose index-query time grows as ``(n / n_ref) ** exponent`` beyond ``n_ref`` tokens (from its
    value at ``n_ref``), everything else delegated: a what-if for how the crossover depends on query growth."""

    base: Any
    n_ref: int
    exponent: float

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def select_job_s(self, shape: Any, pager: str, n: int, budget: int, page_size: int, notes: list[str] | None = None) -> float:
        if n <= self.n_ref:
            return self.base.select_job_s(shape, pager, n, budget, page_size, notes)
        return self.base.select_job_s(shape, pager, self.n_ref, budget, page_size, notes) * (n / self.n_ref) ** self.exponent


def _fmt_tokens(x: float) -> str:
    if math.isinf(x):
        return "never (up to 4M)" if x > 0 else "already at 1k"
    return f"{x / 1000:.0f}k"


def _scale_matching(sim: Simulator, profile: Any, hit: Any, extrapolation: str, cfg: SimConfig, tpot_s: float) -> float:
    """The host time scale at which ``cfg``'s simulated TPOT equals ``tpot_s`` (bisection in log scale; TPOT grows
    with the host's index work)."""
    costs = sim.costs(cfg.hardware)

    def tpot(scale: float) -> float:
        alt = Simulator(profile, hit, extrapolation)
        alt._costs[cfg.hardware] = dataclasses.replace(costs, host_time_scale=scale)
        return alt.run(cfg, with_prefill=False).tpot_s

    lo, hi = 1e-3, 1e3
    if not tpot(lo) <= tpot_s <= tpot(hi):
        return math.nan
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if tpot(mid) < tpot_s else (lo, mid)
    return math.sqrt(lo * hi)


def crossover_report(args: Any) -> str:
    """The ``crossover`` command: where the variant and full KV swap places, what drives it, and how sensitive it is."""
    from icecache.sim import anchors
    from icecache.sim.hitrate import load_hit_model

    profile = load_profile_arg(args)
    hit = load_hit_model(args.hit, args.extrapolation) if args.hit else None
    sim = Simulator(profile, hit, args.extrapolation)
    cfg = SimConfig(get_shape(args.model).name, canonical_hardware(args.hardware), args.variant, 100_000, budget=args.budget,
                    page_size=args.page_size, threads=args.threads, reuse=args.reuse, impl=getattr(args, "impl", "paper"))
    cr = crossings(sim, cfg)
    x = find_crossover(sim, cfg)
    lines = [f"{cfg.variant} vs full KV on {cfg.hardware} / {cfg.model} (budget {cfg.budget}, page {cfg.page_size}, "
             f"{cfg.threads} threads, reuse {cfg.reuse}, {cfg.impl} implementation): becomes faster at {_fmt_tokens(x)}; all swaps in 1k..4M: "
             + (", ".join(f"{d} at {_fmt_tokens(t)}" for t, d in cr) or "none")]
    lines += ["", "| context | full TPOT ms | variant TPOT ms | select | insert | load (gather+copy+scatter) | attend | compute |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in (8_000, 36_000, 100_000, 200_000, 300_000, 500_000, 1_000_000):
        f = sim.run(cfg.replace(context=n, variant="full"), with_prefill=False)
        v = sim.run(cfg.replace(context=n), with_prefill=False)
        st = v.stages
        lines.append(f"| {n / 1000:.0f}k | {f.tpot_s * 1e3:.1f} | {v.tpot_s * 1e3:.1f} | {st['select'] * 1e3:.1f} | {(st['insert'] + st['prefetch']) * 1e3:.1f} | "
                     f"{(st['gather'] + st['copy'] + st['scatter']) * 1e3:.1f} | {(st['attend'] + st['dense_attend']) * 1e3:.1f} | {st['compute'] * 1e3:.1f} |")
    v = sim.run(cfg.replace(context=200_000), with_prefill=False)
    lines += ["", f"hit source: {v.hit_source}; notes at 200k: {'; '.join(sorted(set(v.notes))) or 'none'}"]
    costs = sim.costs(cfg.hardware)
    scale = getattr(costs, "host_time_scale", 1.0)
    lines.append(f"host time scale {scale:.3g} (index work relative to this machine's measurement)")
    if cfg.hardware != "this-machine":
        hw = get_hardware(cfg.hardware)
        what_ifs: list[tuple[str, Any]] = [
            ("host index work x0.5", dataclasses.replace(costs, host_time_scale=scale * 0.5)),
            ("host index work x2", dataclasses.replace(costs, host_time_scale=scale * 2)),
        ]
        for factor in (0.5, 2.0):
            dev = dataclasses.replace(hw.device, attn_bw_efficiency=dataclasses.replace(
                hw.device.attn_bw_efficiency, value=hw.device.attn_bw_efficiency.value * factor))
            what_ifs.append((f"full-KV attention efficiency x{factor}", dataclasses.replace(costs, hardware=dataclasses.replace(hw, device=dev))))
        for e in (0.0, 0.5):
            what_ifs.append((f"index query time growing as n^{e} beyond 36k (measured: see table)", SelectGrowth(costs, 36_000, e)))
        lines.append("what-ifs (one change each):")
        for label, alt_costs in what_ifs:
            alt = Simulator(profile, hit, args.extrapolation)
            alt._costs[cfg.hardware] = alt_costs
            acr = crossings(alt, cfg)
            lines.append(f"  {label}: " + (", ".join(f"{d} at {_fmt_tokens(t)}" for t, d in acr) or "no swap in 1k..4M"))
    if cfg.hardware == "h100-sxm" and cfg.model == "qwen3-4b" and cfg.variant in ("icecache", "icecache-r"):
        line = anchors.PAPER_H100_QWEN3_ICECACHE if cfg.variant == "icecache" else anchors.PAPER_H100_QWEN3_REUSE
        ref = anchors.line_crossover_tokens(anchors.PAPER_H100_QWEN3_FULL, line)
        lines.append(f"paper (lines through its two points): {_fmt_tokens(ref)}; its {cfg.variant} line "
                     f"{line.intercept_s * 1e3:.0f} ms + {line.slope_s_per_token * 1e6:.2f} us/token vs full "
                     f"{anchors.PAPER_H100_QWEN3_FULL.intercept_s * 1e3:.0f} ms + {anchors.PAPER_H100_QWEN3_FULL.slope_s_per_token * 1e6:.2f} us/token")
        # level vs growth: a host scale fitted to the checked line itself at one context (a diagnostic, not a
        # projection: it uses the target), then where the lines cross with that level
        for n_fit in (36_000, 100_000):
            s_fit = _scale_matching(sim, profile, hit, args.extrapolation, cfg.replace(context=n_fit), line.tpot_s(n_fit))
            alt = Simulator(profile, hit, args.extrapolation)
            alt._costs[cfg.hardware] = dataclasses.replace(costs, host_time_scale=s_fit)
            lines.append(f"diagnostic (fitted to the paper's {cfg.variant} line itself): host index work x{s_fit / scale:.2f} makes "
                         f"{_fmt_tokens(n_fit)} match it ({line.tpot_s(n_fit) * 1e3:.0f} ms); then faster at "
                         f"{_fmt_tokens(find_crossover(alt, cfg))}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- outputs
def load_profile_arg(args: Any) -> CalibrationProfile:
    from icecache.sim.__main__ import _profile_path

    path = _profile_path(getattr(args, "profile", None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileMismatchWarning)
        prof = CalibrationProfile.load(path, strict=getattr(args, "strict_profile", False))
    for w in caught:
        print(f"warning: {w.message}")
    return prof


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0]) if rows else []
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path


def _ref(values: Sequence[int], prefer: int) -> int:
    return prefer if prefer in values else sorted(values)[len(values) // 2]


def write_plots(rows: Sequence[dict[str, Any]], spec: SweepSpec, out_dir: Path) -> list[Path]:
    """TPOT vs context (with crossovers), per-stage breakdown bars, page hit rate and bytes vs budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    b, p, t = _ref(spec.budgets, 256), _ref(spec.page_sizes, 16), max(spec.threads)
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
    from icecache.sim.model import STAGES as stages
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


def write_markdown(rows: Sequence[dict[str, Any]], spec: SweepSpec, out: Path, *, command: str, wall_s: float,
                   workers: int, backend: str, profile: CalibrationProfile | None, plots: Sequence[Path],
                   loadavg: Sequence[float] | None = None, total_s: float | None = None) -> Path:
    """The sweep summary: command and wall time, TPOT table, crossovers, breakdown, caveats."""
    b, p, t = _ref(spec.budgets, 256), _ref(spec.page_sizes, 16), max(spec.threads)
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
    xs = [x for x in crossovers(rows) if x["budget"] == b and x["page_size"] == p and x["threads"] == t]
    if xs:
        lines += ["## Crossover with full KV (context where the variant's TPOT drops below full KV's)", "",
                  "| hardware | model | variant | crossover (k tokens) |", "|---|---|---|---:|"]
        for x in xs:
            c = x["crossover_tokens"]
            txt = f"{c / 1000:.0f}" if math.isfinite(c) else ("below grid" if c < 0 else "beyond grid")
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
              f"- Implementation modelled: `{spec.impl}` (icecache.sim.model docstring); dense layers: the global layers below {spec.dense_layers}.",
              "- Busy times per stage can sum to more than TPOT where stages overlap (background inserts, the paper's "
              "icecache-r early loads).", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{q.stem}]({q.name})" for q in plots] + [""]
    out.write_text("\n".join(lines))
    return out


def run_sweep_cli(spec: SweepSpec, args: Any, argv: Sequence[str] | None = None) -> int:
    """The ``sweep`` command."""
    import shlex
    import sys

    profile = load_profile_arg(args)
    hit = load_hit_model(args.hit, args.extrapolation) if args.hit else None
    configs = spec.configs()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_workers = args.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    print(f"simulating {len(configs)} configurations ({args.backend}, {n_workers} workers) ...")
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    rows = run_configs(configs, profile, hit, extrapolation=args.extrapolation, workers=n_workers, backend=args.backend,
                       with_prefill=not args.no_prefill)
    wall = time.perf_counter() - t0
    print(f"done in {wall:.1f} s")
    write_csv(rows, out_dir / "results.csv")
    plots = [] if args.no_plots else write_plots(rows, spec, out_dir)
    cmd = "python -m icecache.sim " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    md = write_markdown(rows, spec, out_dir / "summary.md", command=cmd, wall_s=wall, workers=n_workers,
                        backend=args.backend, profile=profile, plots=plots, loadavg=load, total_s=time.perf_counter() - t0)
    print(f"wrote {out_dir / 'results.csv'}, {md}" + (f", {len(plots)} plots" if plots else ""))
    for x in crossovers(rows):
        if x["budget"] == _ref(spec.budgets, 256) and x["page_size"] == _ref(spec.page_sizes, 16) and x["threads"] == max(spec.threads):
            c = x["crossover_tokens"]
            print(f"  crossover {x['hardware']}/{x['model']}/{x['variant']}: " + (f"{c / 1000:.0f}k" if math.isfinite(c) else str(c)))
    return 0


def paper_report(args: Any) -> str:
    """The ``paper`` command: the A100 / Llama-3.1-8B / 36k breakdown, fed with the paper's component times and
    predicted from the profiles, next to the published numbers."""
    from icecache.sim import anchors
    from icecache.sim.hitrate import load_hit_model
    from icecache.sim.model import component_plan, simulate_step

    a = anchors.PAPER_A100_36K
    shape = get_shape(a.model)
    lines = [f"# {a.name}: {a.model} on {a.hardware}, {a.context} tokens, {a.threads} threads", "",
             f"Source: {a.source}. Assumed (not stated by the paper): {', '.join(a.assumed)}.", "",
             "| | TPOT s | DCI query | decoding | loading | other |", "|---|---:|---:|---:|---:|---:|",
             f"| paper | {a.tpot_s} | {a.select_s} | {a.decode_s} | {a.load_s} | {a.other_s} |"]
    fed = simulate_step(component_plan(layers=shape.layers, select_s=a.select_s, decode_s=a.decode_s, load_s=a.load_s,
                                       other_s=a.other_s, kv_heads=shape.kv_heads, threads=a.threads))
    lines.append(f"| engine fed the paper's components | {fed.seconds:.4f} | {fed.busy['select']:.4f} | {fed.busy['compute']:.4f} | "
                 f"{fed.busy['gather']:.4f} | {fed.busy['other']:.4f} |")
    for r in (2, 4, 8):
        fr = simulate_step(component_plan(layers=shape.layers, select_s=a.select_s, decode_s=a.decode_s, load_s=a.load_s,
                                          other_s=a.other_s, kv_heads=shape.kv_heads, threads=a.threads, reuse=r))
        lines.append(f"| same, reuse r={r} (paper: {a.tpot_reuse_s}) | {fr.seconds:.4f} | {fr.busy['select']:.4f} | "
                     f"{fr.busy['compute']:.4f} | {fr.busy['gather']:.4f} | {fr.busy['other']:.4f} |")
    profile = load_profile_arg(args)
    hit = load_hit_model(args.hit, args.extrapolation) if args.hit else None
    sim = Simulator(profile, hit, args.extrapolation)
    cfg = SimConfig(a.model, a.hardware, "icecache", a.context, budget=a.budget, page_size=a.page_size, threads=a.threads,
                    dense_layers=a.dense_layers, new_tokens=1, impl="paper")
    for v, label in (("icecache", "predicted from the profiles"), ("icecache-r", f"predicted, reuse r={cfg.reuse}")):
        res = sim.run(cfg.replace(variant=v))
        c = res.components()
        lines.append(f"| {label} | {res.tpot_s:.4f} | {c['dci_query']:.4f} | {c['decoding']:.4f} | {c['loading']:.4f} | "
                     f"{c['other']:.4f} |")
        lines.append(f"|  (TT2T {res.tt2t_s:.2f} s; paper {a.tt2t_s if v == 'icecache' else a.tt2t_reuse_s} s) | | | | | |")
    full = sim.run(cfg.replace(variant="full"))
    lines += ["", f"Full KV predicted on the same machine: TPOT {full.tpot_s:.4f} s, TT2T {full.tt2t_s:.2f} s.",
              f"Host time scale {getattr(sim.costs(a.hardware), 'host_time_scale', 1.0):.3g} (fitted to this anchor's DCI "
              "time, so the predicted DCI column matches it by construction; every other column is a prediction).",
              f"Hit-rate source: {res.hit_source}.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- projection
def projection(args: Any) -> tuple[list[dict[str, Any]], str, list[Path]]:
    """The ``project`` command: TPOT vs context of a few variants for one model on one machine, written as
    ``<out>.csv``, ``<out>.md`` and ``<out>.png`` when ``args.out`` is set (else nothing is written).
    Returns (rows, Markdown, written paths)."""
    import shlex
    import sys

    from icecache.sim.hitrate import load_hit_model

    profile = load_profile_arg(args)
    hit = load_hit_model(args.hit, args.extrapolation) if args.hit else None
    sim = Simulator(profile, hit, args.extrapolation)
    from icecache.sim.__main__ import _dense_layers

    contexts = parse_contexts(args.context)
    variants = [v.strip() for v in str(args.variants).split(",") if v.strip()]
    shape = get_shape(args.model)
    base = dict(model=shape.name, hardware=canonical_hardware(args.hardware), budget=args.budget, page_size=args.page_size,
                sink=args.sink, window=args.window, threads=args.threads, dense_layers=_dense_layers(args.dense_layers),
                reuse=args.reuse, impl=args.impl, new_tokens=args.new_tokens)
    t0 = time.perf_counter()
    rows = []
    for v in variants:
        for n in contexts:
            rows.append(sim.run(SimConfig(variant=v, context=n, **{**base, "budget": min(args.budget, n)})).to_row())
    wall = time.perf_counter() - t0
    out = Path(args.out) if getattr(args, "out", None) else None
    paths: list[Path] = []
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        paths.append(write_csv(rows, out.with_suffix(".csv")))
    cmd = "python -m icecache.sim " + " ".join(shlex.quote(a) for a in (args.argv if getattr(args, "argv", None) is not None else sys.argv[1:]))
    by = {(r["variant"], r["context"]): r for r in rows}
    xs = crossovers([dict(r, budget=r["budget"] if r["variant"] != "full" else 0) for r in rows])
    lines = [f"# Simulator projection: {shape.name} on {base['hardware']}", "",
             f"Command: `{cmd}` ({len(rows)} configurations, {wall:.1f} s).", "",
             f"Model: {shape.layers} layers, {shape.num_sliding} sliding-window layers of {shape.sliding_window} tokens, "
             f"global layers {list(shape.global_layers)}; {shape.q_heads} query / {shape.kv_heads} KV heads of {shape.head_dim}. "
             f"Source: {shape.source}.", "",
             f"IceCache: budget {args.budget}, page {args.page_size}, sink {args.sink}, window {args.window}, dense layers "
             f"{args.dense_layers}, {args.threads} threads, `{args.impl}` implementation; {args.new_tokens} new tokens.", "",
             "TPOT (steady) is one decode step at the mean decode context; TPOT (runtime) is how the runtime reports it, "
             "(end - TTFT) / (new tokens - 1), which includes the first decode step (it waits for the index builds).", "",
             "| context | " + " | ".join(f"{v} TPOT steady ms | {v} TPOT runtime ms | {v} TT2T s" for v in variants) + " |",
             "|---:|" + "---:|---:|---:|" * len(variants)]
    for n in contexts:
        cells = []
        for v in variants:
            r = by[(v, n)]
            cells += [f"{r['tpot_s'] * 1e3:.1f}", f"{r['tpot_mean_s'] * 1e3:.1f}", f"{r['tt2t_s']:.2f}"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    for x in xs:
        c = x["crossover_tokens"]
        txt = (f"at about {c:.0f} tokens" if math.isfinite(c) else ("already at the smallest context" if c < 0 else "not within the grid"))
        lines.append(f"- {x['variant']} becomes faster than full KV (steady TPOT): {txt}.")
    sample = rows[-1]
    stage_txt = ", ".join(f"{k[6:-2]} {float(sample[k]) * 1e3:.2f}" for k in sample if k.startswith("stage_") and float(sample[k]) > 0)
    lines += ["", f"Busy ms per step of {sample['variant']} at {sample['context']} tokens: {stage_txt}.", "",
              "Caveats:", ""]
    notes = sorted({nt for r in rows for nt in str(r["notes"]).split(" | ") if nt})
    ext = sum(1 for r in rows if r["extrapolated"])
    lines += [f"- {ext} of {len(rows)} rows use a predictor or the hit model outside its measured range; every row's "
              "notes are in the CSV. Distinct notes:"] + [f"  - {nt}" for nt in notes] + [""]
    if out is not None and not getattr(args, "no_plots", False):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for v in variants:
            rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["context"])
            line, = ax.plot([r["context"] / 1000 for r in rs], [r["tpot_s"] * 1e3 for r in rs], marker="o", ms=3, label=f"{v} (steady)")
            ax.plot([r["context"] / 1000 for r in rs], [r["tpot_mean_s"] * 1e3 for r in rs], ls="--", color=line.get_color(),
                    label=f"{v} (runtime TPOT)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"simulated {shape.name} on {base['hardware']}\nbudget {args.budget}, page {args.page_size}, "
                     f"{args.threads} threads, dense layers {args.dense_layers}", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        png = out.with_suffix(".png")
        fig.savefig(png, dpi=120)
        plt.close(fig)
        paths.append(png)
        lines += [f"![TPOT vs context]({png.name})", ""]
    md = "\n".join(lines)
    if out is not None:
        out.with_suffix(".md").write_text(md)
        paths.insert(1, out.with_suffix(".md"))
    return rows, md, paths
