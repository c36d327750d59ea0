"""Figures of the index benchmark: quality vs budget, part B scaling, and the Pareto view."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["pareto_front", "plot_pareto", "plot_results"]


def pareto_front(points: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the points no other point beats on both time (lower) and recall (higher)."""
    return {i for i, (t, r) in enumerate(points)
            if not any((t2 <= t and r2 >= r) and (t2 < t or r2 > r) for t2, r2 in points)}


def plot_pareto(path: Path, rows: list[dict[str, Any]], budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fam in dict.fromkeys(r["family"] for r in rows):
        rs = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["select_ms_per_step"])
        ax.plot([r["select_ms_per_step"] for r in rs], [r["attention_recall"] for r in rs], marker="o", label=fam)
        for r in rs:
            tag = r["method"][len(fam):] or "default"
            ax.annotate(tag, (r["select_ms_per_step"], r["attention_recall"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    fr = sorted((r for r in rows if r["pareto_optimal"]), key=lambda r: r["select_ms_per_step"])
    ax.plot([r["select_ms_per_step"] for r in fr], [r["attention_recall"] for r in fr], "k--", lw=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("select time per decode step, all sparse layers x KV heads (ms, log)")
    ax.set_ylabel(f"attention recall @ budget {budget}")
    ax.set_title("Pagers: quality vs query cost (captured SmolLM2 keys)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_results(path: Path, summary: dict[tuple[str, int], dict[str, float]], budgets: Sequence[int],
          scaling_rows: list[dict[str, Any]], sizes: Sequence[int], bscale: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    methods = list(dict.fromkeys(m for m, _ in summary))
    for m in methods:
        ax.plot(budgets, [summary[(m, b)]["attention_recall"] for b in budgets], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens)")
    ax.set_ylabel("attention recall (mean over sparse layers)")
    ax.set_title("Part A: quality")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    bmid = bscale
    for data, style in (("real", "-"), ("synthetic", "--")):
        rs = [r for r in scaling_rows if r["data"] == data]
        if not rs:
            continue
        ns = sorted({r["n"] for r in rs})
        for m in [k[: -len(f"_select_ms@{bmid}")] for k in rs[0] if k.endswith(f"_select_ms@{bmid}")]:
            t = [np.mean([r[f"{m}_select_ms@{bmid}"] for r in rs if r["n"] == n]) for n in ns]
            rec = [np.mean([r[f"{m}_recall@{bmid}"] for r in rs if r["n"] == n]) for n in ns]
            axes[1].plot(ns, t, style, marker="o", label=f"{m} ({data})")
            axes[2].plot(ns, rec, style, marker="o", label=f"{m} ({data})")
    for ax, title, ylabel in ((axes[1], "Part B: select time per GQA group", "ms"), (axes[2], f"Part B: attention recall @{bmid}", "recall")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("keys per KV head")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if scaling_rows:
        axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
