"""Crossovers: where a variant and full KV swap places, found on a sweep's grid (`crossovers`) or by a scan
and bisection over context (`crossings`, `find_crossover`), and the ``crossover`` command's report.

`describe_crossover` is the one wording of a grid crossover (a context, "below grid" or "beyond grid") that
every command prints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from icecache.sim import anchors
from icecache.sim.config import SimConfig
from icecache.sim.costs import CostModel, CostModelWrapper
from icecache.sim.hardware import get_hardware
from icecache.sim.shapes import ModelShape
from icecache.sim.simulator import Simulator

__all__ = ["crossovers", "describe_crossover", "crossings", "find_crossover", "SelectGrowth", "scale_matching", "crossover_report"]


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


def describe_crossover(tokens: float) -> str:
    """A grid crossover of `crossovers` as every command prints it: ``"36k"``, ``"below grid"`` (faster already
    at the smallest context) or ``"beyond grid"`` (still slower at the largest)."""
    if math.isfinite(tokens):
        return f"{tokens / 1000:.0f}k"
    return "below grid" if tokens < 0 else "beyond grid"


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
class SelectGrowth(CostModelWrapper):
    """A cost model whose index-query time grows as ``(n / n_ref) ** exponent`` beyond ``n_ref`` tokens (from its
    value at ``n_ref``), everything else as ``base``: a what-if for how the crossover depends on query growth."""

    n_ref: int = 36_000
    exponent: float = 1.0

    def select_job_s(self, shape: ModelShape, pager: str, n: int, budget: int, page_size: int, notes: list[str] | None = None) -> float:
        if n <= self.n_ref:
            return self.base.select_job_s(shape, pager, n, budget, page_size, notes)
        return self.base.select_job_s(shape, pager, self.n_ref, budget, page_size, notes) * (n / self.n_ref) ** self.exponent


def _scan_label(x: float) -> str:
    """A crossover of `crossings`/`find_crossover` over their 1k..4M scan."""
    if math.isinf(x):
        return "never (up to 4M)" if x > 0 else "already at 1k"
    return f"{x / 1000:.0f}k"


def scale_matching(sim: Simulator, cfg: SimConfig, tpot_s: float) -> float:
    """The host time scale at which ``cfg``'s simulated TPOT equals ``tpot_s`` (bisection in log scale; TPOT grows
    with the host's index work); NaN when no scale in [1e-3, 1e3] reaches it. ``cfg.hardware`` must be a GPU
    server (its cost model has a host time scale)."""
    costs = sim.costs(cfg.hardware)

    def tpot(scale: float) -> float:
        return sim.with_costs(cfg.hardware, dataclasses.replace(costs, host_time_scale=scale)).run(cfg, with_prefill=False).tpot_s

    lo, hi = 1e-3, 1e3
    if not tpot(lo) <= tpot_s <= tpot(hi):
        return math.nan
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if tpot(mid) < tpot_s else (lo, mid)
    return math.sqrt(lo * hi)


def crossover_report(sim: Simulator, cfg: SimConfig) -> str:
    """The ``crossover`` command: where ``cfg.variant`` and full KV swap places on ``cfg.hardware`` / ``cfg.model``
    (``cfg.context`` is ignored), what drives it, and how sensitive it is (what-ifs on a GPU server)."""
    cr = crossings(sim, cfg)
    x = find_crossover(sim, cfg)
    lines = [f"{cfg.variant} vs full KV on {cfg.hardware} / {cfg.model} (budget {cfg.budget}, page {cfg.page_size}, "
             f"{cfg.threads} threads, reuse {cfg.reuse_every}, {cfg.impl} implementation): becomes faster at {_scan_label(x)}; all swaps in 1k..4M: "
             + (", ".join(f"{d} at {_scan_label(t)}" for t, d in cr) or "none")]
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
    scale = float(getattr(costs, "host_time_scale", 1.0))
    lines.append(f"host time scale {scale:.3g} (index work relative to this machine's measurement)")
    if cfg.hardware != "this-machine":
        hw = get_hardware(cfg.hardware)
        what_ifs: list[tuple[str, CostModel]] = [
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
            acr = crossings(sim.with_costs(cfg.hardware, alt_costs), cfg)
            lines.append(f"  {label}: " + (", ".join(f"{d} at {_scan_label(t)}" for t, d in acr) or "no swap in 1k..4M"))
    if cfg.hardware == "h100-sxm" and cfg.model == "qwen3-4b" and cfg.variant in ("icecache", "icecache-r"):
        line = anchors.PAPER_H100_QWEN3_ICECACHE if cfg.variant == "icecache" else anchors.PAPER_H100_QWEN3_REUSE
        ref = anchors.line_crossover_tokens(anchors.PAPER_H100_QWEN3_FULL, line)
        lines.append(f"paper (lines through its two points): {_scan_label(ref)}; its {cfg.variant} line "
                     f"{line.intercept_s * 1e3:.0f} ms + {line.slope_s_per_token * 1e6:.2f} us/token vs full "
                     f"{anchors.PAPER_H100_QWEN3_FULL.intercept_s * 1e3:.0f} ms + {anchors.PAPER_H100_QWEN3_FULL.slope_s_per_token * 1e6:.2f} us/token")
        # level vs growth: a host scale fitted to the checked line itself at one context (a diagnostic, not a
        # projection: it uses the target), then where the lines cross with that level
        for n_fit in (36_000, 100_000):
            s_fit = scale_matching(sim, cfg.replace(context=n_fit), line.tpot_s(n_fit))
            alt = sim.with_costs(cfg.hardware, dataclasses.replace(costs, host_time_scale=s_fit))
            lines.append(f"diagnostic (fitted to the paper's {cfg.variant} line itself): host index work x{s_fit / scale:.2f} makes "
                         f"{_scan_label(n_fit)} match it ({line.tpot_s(n_fit) * 1e3:.0f} ms); then faster at "
                         f"{_scan_label(find_crossover(alt, cfg))}")
    return "\n".join(lines)
