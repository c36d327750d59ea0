"""Reports of one question each: the paper's A100 breakdown (``paper``) and a TPOT-vs-context projection of
one model on one machine (``project``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from icecache.core.report import write_csv
from icecache.sim import anchors
from icecache.sim.config import SimConfig
from icecache.sim.crossover import crossovers
from icecache.sim.engine import simulate_step
from icecache.sim.inputs import format_dense_layers
from icecache.sim.plans import component_plan
from icecache.sim.shapes import get_shape
from icecache.sim.simulator import Simulator

__all__ = ["paper_report", "projection"]


def paper_report(sim: Simulator) -> str:
    """The ``paper`` command: the A100 / Llama-3.1-8B / 36k breakdown, fed with the paper's component times and
    predicted from ``sim``'s profile and hit model, next to the published numbers."""
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
                                          other_s=a.other_s, kv_heads=shape.kv_heads, threads=a.threads, reuse_every=r))
        lines.append(f"| same, reuse r={r} (paper: {a.tpot_reuse_s}) | {fr.seconds:.4f} | {fr.busy['select']:.4f} | "
                     f"{fr.busy['compute']:.4f} | {fr.busy['gather']:.4f} | {fr.busy['other']:.4f} |")
    cfg = SimConfig(a.model, a.hardware, "icecache", a.context, budget=a.budget, page_size=a.page_size, threads=a.threads,
                    dense_layers=tuple(range(a.dense_layers)), reuse_every=a.reuse_every, new_tokens=1, impl="paper")
    for v, label in (("icecache", "predicted from the profiles"), ("icecache-r", f"predicted, reuse r={cfg.reuse_every}")):
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


def projection(sim: Simulator, template: SimConfig, contexts: Sequence[int], variants: Sequence[str], *,
               out: str | Path | None = None, plots: bool = True, command: str = "") -> tuple[list[dict[str, Any]], str, list[Path]]:
    """The ``project`` command: TPOT vs context of ``variants`` for ``template``'s model on its machine (every
    other setting from ``template``; the budget is capped at each context), written as ``<out>.csv``,
    ``<out>.md`` and ``<out>.png`` (unless not ``plots``) when ``out`` is given (else nothing is written).
    Returns (rows, Markdown, written paths)."""
    shape = get_shape(template.model)
    t = template
    t0 = time.perf_counter()
    rows = []
    for v in variants:
        for n in contexts:
            rows.append(sim.run(t.replace(variant=v, context=n, budget=min(t.budget, n))).to_row())
    wall = time.perf_counter() - t0
    out = Path(out) if out else None
    paths: list[Path] = []
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        paths.append(write_csv(out.with_suffix(".csv"), rows, float_format=".6g"))
    by = {(r["variant"], r["context"]): r for r in rows}
    xs = crossovers([dict(r, budget=r["budget"] if r["variant"] != "full" else 0) for r in rows])
    lines = [f"# Simulator projection: {shape.name} on {t.hardware}", "",
             f"Command: `{command}` ({len(rows)} configurations, {wall:.1f} s).", "",
             f"Model: {shape.layers} layers, {shape.num_sliding} sliding-window layers of {shape.sliding_window} tokens, "
             f"global layers {list(shape.global_layers)}; {shape.q_heads} query / {shape.kv_heads} KV heads of {shape.head_dim}. "
             f"Source: {shape.source}.", "",
             f"IceCache: budget {t.budget}, page {t.page_size}, sink {t.sink}, window {t.window}, dense layers "
             f"{format_dense_layers(t.dense_layers)}, {t.threads} threads, `{t.impl}` implementation; {t.new_tokens} new tokens.", "",
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
    if out is not None and plots:
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
        ax.set_title(f"simulated {shape.name} on {t.hardware}\nbudget {t.budget}, page {t.page_size}, "
                     f"{t.threads} threads, dense layers {format_dense_layers(t.dense_layers)}", fontsize=8)
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
