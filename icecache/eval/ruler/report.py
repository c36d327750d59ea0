"""RULER results: per-cell scores, the table in RULER's shape, bootstrap intervals and plots.

A *row* is a method at a budget (``full`` has none); a *cell* is (length, row, task). A task's score is the
mean sample score x 100 (RULER). The average of a row is the mean of its task scores; its 95% interval is a
percentile bootstrap that resamples the samples of every task independently (the average's sampling noise).
Only samples that every row of a length has finished enter that length's table, so rows stay comparable
while a run is still going.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def row_label(method: str, budget: str) -> str:
    return method if budget == "-" else f"{method}@{budget}"


def _row_order(label: str) -> tuple:
    method, _, budget = label.partition("@")
    return (method != "full", method.startswith("kvpress:"), method, int(budget) if budget.isdigit() else -1)


def complete_scores(records: Sequence[dict[str, Any]]) -> dict[int, dict[str, dict[str, dict[int, float]]]]:
    """``{length: {row: {task: {index: score}}}}`` restricted, per (length, task), to the sample indices that
    every row has finished."""
    table: dict[int, dict[str, dict[str, dict[int, float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in records:
        table[int(r["length"])][row_label(r["method"], str(r["budget"]))][r["task"]][int(r["index"])] = float(r["score"])
    out: dict[int, dict[str, dict[str, dict[int, float]]]] = {}
    for length, rows in table.items():
        tasks = sorted({t for row in rows.values() for t in row})
        kept: dict[str, dict[str, dict[int, float]]] = {row: {} for row in rows}
        for task in tasks:
            common = set.intersection(*(set(rows[row].get(task, {})) for row in rows))
            for row in rows:
                kept[row][task] = {i: rows[row][task][i] for i in sorted(common)}
        out[length] = kept
    return out


def bootstrap_average(per_task: dict[str, list[float]], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean over tasks of each task's mean score, resampling within tasks."""
    tasks = [np.asarray(v, dtype=np.float64) for v in per_task.values() if len(v)]
    if not tasks or all(len(v) < 2 for v in tasks):
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = np.zeros(reps)
    for v in tasks:
        means += v[rng.integers(0, len(v), size=(reps, len(v)))].mean(axis=1)
    means /= len(tasks)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarize(records: Sequence[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """One entry per (length, row): task scores (x100), the average and its interval, and the samples behind
    them (``task_samples`` per task, ``samples`` the fewest of any task)."""
    out = []
    for length, rows in sorted(complete_scores(records).items()):
        for row, tasks in sorted(rows.items(), key=lambda kv: _row_order(kv[0])):
            per_task = {t: list(s.values()) for t, s in tasks.items() if s}
            if not per_task:
                continue
            scores = {t: 100 * float(np.mean(v)) for t, v in per_task.items()}
            lo, hi = bootstrap_average(per_task, seed=seed)
            out.append({
                "length": length, "row": row, "tasks": scores, "average": float(np.mean(list(scores.values()))),
                "ci_low": 100 * lo, "ci_high": 100 * hi, "samples": min(len(v) for v in per_task.values()),
                "task_samples": {t: len(v) for t, v in per_task.items()}, "num_tasks": len(per_task),
            })
    return out


def results_rows(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows for ``results.csv``: one per (length, row, task) plus the average."""
    rows = []
    for e in summary:
        method, _, budget = e["row"].partition("@")
        for task, score in e["tasks"].items():
            rows.append({"length": e["length"], "method": method, "budget": budget or "-", "task": task,
                         "score": round(score, 4), "samples": e["task_samples"][task]})
        rows.append({"length": e["length"], "method": method, "budget": budget or "-", "task": "average",
                     "score": round(e["average"], 4), "ci_low": round(e["ci_low"], 4), "ci_high": round(e["ci_high"], 4),
                     "samples": e["samples"]})
    return rows


def markdown(summary: Sequence[dict[str, Any]], task_order: Sequence[str]) -> str:
    """One table per length in RULER's shape: rows method@budget, columns the tasks and the average."""
    lines: list[str] = []
    for length in sorted({e["length"] for e in summary}):
        es = [e for e in summary if e["length"] == length]
        tasks = [t for t in task_order if any(t in e["tasks"] for e in es)]
        counts = {n for e in es for n in e["task_samples"].values()}
        n = str(min(counts)) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
        lines.append(f"\n**{length} tokens** ({n} samples per task; scores x100; average with a bootstrap 95% interval)\n")
        lines.append("| method | " + " | ".join(tasks) + " | average |")
        lines.append("|---|" + "---:|" * (len(tasks) + 1))
        for e in es:
            cells = [f"{e['tasks'][t]:.1f}" if t in e["tasks"] else "" for t in tasks]
            avg = f"**{e['average']:.1f}**"
            if not math.isnan(e["ci_low"]):
                avg += f" [{e['ci_low']:.1f}, {e['ci_high']:.1f}]"
            lines.append(f"| {e['row']} | " + " | ".join(cells) + f" | {avg} |")
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Left: average vs length per row. Right: average relative to full vs budget per method, one line per
    length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_len, ax_bud) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = sorted({e["row"] for e in summary}, key=_row_order)
    for row in rows:
        pts = sorted((e["length"], e) for e in summary if e["row"] == row)
        xs = [p[0] for p in pts]
        ys = [p[1]["average"] for p in pts]
        # clamped at 0: a degenerate bootstrap (every resample the same mean) can land a rounding error on
        # the wrong side of the average, and matplotlib refuses negative error bars
        err = [[max(0.0, y - p[1]["ci_low"]) if not math.isnan(p[1]["ci_low"]) else 0 for y, p in zip(ys, pts)],
               [max(0.0, p[1]["ci_high"] - y) if not math.isnan(p[1]["ci_high"]) else 0 for y, p in zip(ys, pts)]]
        ax_len.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=row, lw=2 if row == "full" else 1,
                        color="k" if row == "full" else None)
    ax_len.set_xscale("log", base=2)
    ax_len.set_xlabel("length (tokens)")
    ax_len.set_ylabel("RULER average (x100)")
    ax_len.legend(fontsize=6, ncol=2)
    full = {e["length"]: e["average"] for e in summary if e["row"] == "full"}
    methods = sorted({e["row"].partition("@")[0] for e in summary if "@" in e["row"]})
    for method in methods:
        for length in sorted(full):
            pts = sorted((int(e["row"].partition("@")[2]), e["average"] / full[length])
                         for e in summary if e["length"] == length and e["row"].partition("@")[0] == method
                         and full[length] > 0)
            if pts:
                ax_bud.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{method} ({length})")
    ax_bud.axhline(1.0, color="k", ls="--", lw=1)
    ax_bud.set_xscale("log", base=2)
    ax_bud.set_xlabel("budget (tokens)")
    ax_bud.set_ylabel("average / full attention's")
    if ax_bud.get_legend_handles_labels()[0]:
        ax_bud.legend(fontsize=6, ncol=2)
    else:  # a run without full attention's rows (or with a zero average): nothing to divide by
        ax_bud.text(0.5, 0.5, "no full-attention average to compare with", ha="center", va="center",
                    transform=ax_bud.transAxes, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
