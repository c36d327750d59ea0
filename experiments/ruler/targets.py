"""Issue 23's accuracy targets, read from the committed RULER runs: one table, regenerated at every snapshot.

    python experiments/ruler/targets.py           # writes targets.md (printed) and targets_<model>.png
    python experiments/ruler/targets.py --check   # exit 1 when targets.md differs from what the runs give

Each (model, length) cell names the rows it reads (folder, method, budget): the adopted settings' rows for
IceCache and Quest, full attention and the other baselines from the main run of the same samples. Every target
is read on the samples all of the cell's rows have finished, with a paired bootstrap 95% interval resampled within
each task (4,000 draws, seed 0), and beside it the samples won and lost: a sample is won when the left row's score
beats the reference (the right row's score plus the threshold for a difference, the threshold times the right
row's score for a ratio, e.g. 95% of full attention's), lost when it falls short, and tied (dropped) otherwise;
a two-sided exact sign test (binomial, p = 1/2, ``math.comb``) gives the p-value of wins against losses, and
Holm's step-down correction runs over every target the table tests (all but ``not run yet`` and ``undefined``) at
a family-wise level of 0.05.

Verdicts: ``met`` / ``missed`` on the letter (the point estimate against the threshold), then ``settled`` only when
both (a) the bootstrap interval excludes the threshold on that side (its low end above it for ``met``, its high
end below it for ``missed``) and (b) the sign test rejects no difference after Holm's correction, in the same
direction (more wins than losses for ``met``, more losses than wins for ``missed``); ``within noise`` otherwise.
``running`` while the cell has fewer samples than the issue asks for.

Plots never mix task sets: where a model's lengths ran different tasks (Gemma-3-270M's 32k ran RULER's 8 NIAH
tasks, 4k-16k its 11), the average-vs-length panel on the full set holds only the lengths that ran it, and a
second panel plots every length on the tasks all of them ran ("8 NIAH tasks").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "targets.md"
DRAWS = 4000
ALPHA = 0.05  # the family-wise level of Holm's correction over the table's sign tests


@dataclass(frozen=True)
class Row:
    """One row of one run folder: ``method`` and ``budget`` as the records spell them (``full``, ``-``)."""

    folder: str
    method: str
    budget: str

    def label(self) -> str:
        return f"`{self.folder}/` {self.method}@{self.budget}"


@dataclass(frozen=True)
class Cell:
    """One model at one length: the rows each target reads and the samples the issue asks for."""

    model: str
    length: str
    samples: int
    rows: dict[str, Row]


def _cell(model: str, length: str, samples: int, main: str, adopted: str | None = None, icecache: str = "icecache",
          quest: str = "quest", icecache_run: str | None = None) -> Cell:
    """Full attention, PQCache and SnapKV from ``main``; IceCache and Quest from ``adopted`` (default ``main``),
    IceCache from ``icecache_run`` where it was re-run alone with later settings."""
    adopted = adopted or main
    icecache_run = icecache_run or adopted
    return Cell(model, length, samples, {
        "full": Row(main, "full", "-"),
        "icecache@256": Row(icecache_run, icecache, "256"),
        "icecache@64": Row(icecache_run, icecache, "64"),
        "quest@256": Row(adopted, quest, "256"),
        "pqcache@256": Row(main, "pqcache", "256"),
        "snapkv@256": Row(main, "snapkv", "256"),
    })


# The adopted settings: SmolLM2 pages of 16 (the defaults); Gemma-3-270M pages of 4 and M-DCI's field of view 200
# (question 1 of README.md), applied by the command line from 16k on and run as method variants at 4k and 8k;
# since question 3 the field of view grows beyond 8k (2.4% of the indexed tokens, between 200 and 400): IceCache
# re-run alone with it at 16k (`gemma_16k_settings/`) and 32k (`gemma_32k_settings/`).
CELLS = [
    _cell("SmolLM2-135M", "4k", 11 * 25, "smollm2_4k"),
    _cell("Gemma-3-270M", "4k", 11 * 10, "gemma_4k", adopted="gemma_4k_settings"),
    _cell("Gemma-3-270M", "8k", 11 * 10, "gemma_8k", adopted="gemma_8k_variants",
          icecache="icecache[page_size=4;field_of_view=200]", quest="quest[page_size=4]"),
    _cell("Gemma-3-270M", "16k", 11 * 10, "gemma_16k", icecache_run="gemma_16k_settings"),
    _cell("Gemma-3-270M", "32k", 8 * 5, "gemma_32k", icecache_run="gemma_32k_settings"),
]


@dataclass(frozen=True)
class Target:
    """``a / b >= threshold`` (``ratio``) or ``a - b >= threshold`` (difference, x100 points)."""

    name: str
    a: str
    b: str
    ratio: bool
    threshold: float


TARGETS = [
    Target("IceCache@256 >= 95% of full", "icecache@256", "full", True, 0.95),
    Target("IceCache@256 >= Quest@256", "icecache@256", "quest@256", False, 0.0),
    Target("IceCache@256 >= PQCache@256", "icecache@256", "pqcache@256", False, 0.0),
    Target("IceCache@256 >= SnapKV@256", "icecache@256", "snapkv@256", False, 0.0),
    Target("IceCache@64 >= Quest@256 (headline)", "icecache@64", "quest@256", False, 0.0),
]


def cell_records(root: Path, cell: Cell) -> list[dict]:
    """The records of ``cell``'s rows on the samples all of them finished, each renamed to its role (``icecache``
    at ``256``, ...), as ``icecache.eval.ruler.report.summarize`` reads them."""
    length = {"4k": 4096, "8k": 8192, "16k": 16384, "32k": 32768}[cell.length]
    scores = {role: load_scores(root, row) for role, row in cell.rows.items()}
    common = set.intersection(*(set(v) for v in scores.values()))
    records = []
    for role, values in scores.items():
        method, _, budget = role.partition("@")
        records += [{"task": task, "index": index, "length": length, "method": method, "budget": budget or "-",
                     "score": values[(task, index)]} for task, index in sorted(common)]
    return records


def _task_set_label(tasks: set[str]) -> str:
    return f"{len(tasks)} NIAH tasks" if all(t.startswith("niah") for t in tasks) else f"{len(tasks)} tasks"


def plot_model(records_by_cell: list[list[dict]], path: Path) -> None:
    """One figure: RULER's average vs length per row, one panel per task set (the largest set at the lengths that
    ran it; and, where lengths ran different sets, every length on the tasks all of them ran), and each method's
    average relative to full attention's vs budget, one line per length labelled with its task set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from icecache.eval.ruler.report import _row_order, summarize

    task_sets = [frozenset(r["task"] for r in records) for records in records_by_cell]
    widest = max(task_sets, key=len)
    shared = frozenset.intersection(*task_sets)
    only = sorted({r["length"] // 1024 for recs, ts in zip(records_by_cell, task_sets) if ts == widest for r in recs})
    panels = [(_task_set_label(widest) + ("" if shared == widest else f" ({', '.join(f'{k}k' for k in only)} only)"),
               summarize([r for recs, ts in zip(records_by_cell, task_sets) if ts == widest
                                                   for r in recs]))]
    if shared != widest:
        panels.append((f"{_task_set_label(shared)}, every length",
                       summarize([r for recs in records_by_cell for r in recs if r["task"] in shared])))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5.5 * (len(panels) + 1), 4.2))
    for ax, (title, summary) in zip(axes, panels):
        for row in sorted({e["row"] for e in summary}, key=_row_order):
            pts = sorted((e["length"], e) for e in summary if e["row"] == row)
            ys = [e["average"] for _, e in pts]
            err = [[max(0.0, y - e["ci_low"]) if not math.isnan(e["ci_low"]) else 0 for y, (_, e) in zip(ys, pts)],
                   [max(0.0, e["ci_high"] - y) if not math.isnan(e["ci_high"]) else 0 for y, (_, e) in zip(ys, pts)]]
            ax.errorbar([x for x, _ in pts], ys, yerr=err, marker="o", capsize=3, label=row,
                        lw=2 if row == "full" else 1, color="k" if row == "full" else None)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("RULER average (x100)")
        ax.set_title(f"RULER average on {title}", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    ax_bud = axes[-1]
    lengths = {r["length"] for records in records_by_cell for r in records}
    methods = sorted({r["method"] for records in records_by_cell for r in records} - {"full"})
    colors = {m: f"C{i}" for i, m in enumerate(methods)}  # a color per method, a line style per length
    for records, tasks in zip(records_by_cell, task_sets):  # each length on its own tasks, one line per length
        summary = summarize(records)
        full = {e["length"]: e["average"] for e in summary if e["row"] == "full"}
        for length, base in full.items():
            style = ["-", "--", ":", "-."][sorted(lengths).index(length) % 4]
            for method in sorted({e["row"].partition("@")[0] for e in summary if "@" in e["row"]}):
                pts = sorted((int(e["row"].partition("@")[2]), e["average"] / base) for e in summary
                             if e["length"] == length and e["row"].partition("@")[0] == method and base > 0)
                if pts:
                    ax_bud.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ls=style,
                                color=colors[method],
                                label=f"{method} ({length // 1024}k, {_task_set_label(tasks)})")
    ax_bud.axhline(1.0, color="k", ls="--", lw=1)
    ax_bud.set_xscale("log", base=2)
    ax_bud.set_xlabel("budget (tokens)")
    ax_bud.set_ylabel("average / full attention's (same length, same tasks)")
    ax_bud.set_title("relative to full attention", fontsize=9)
    if ax_bud.get_legend_handles_labels()[0]:
        ax_bud.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(root: Path = HERE, cells: list[Cell] = CELLS) -> list[Path]:
    """``targets_<model>.png`` for every model with records (``plot_model``). A cell enters once at least half of
    its samples are finished."""
    paths = []
    for model in dict.fromkeys(cell.model for cell in cells):
        records_by_cell = []
        for cell in cells:
            if cell.model == model:
                rows = cell_records(root, cell)
                if rows and len(rows) >= len(cell.rows) * cell.samples / 2:  # a cell too early would mislead
                    records_by_cell.append(rows)
        if records_by_cell:
            path = root / f"targets_{model.lower()}.png"
            plot_model(records_by_cell, path)
            paths.append(path)
    return paths


def load_scores(root: Path, row: Row) -> dict[tuple[str, int], float]:
    """``{(task, sample index): score}`` of ``row``; empty when its folder has no records yet."""
    path = root / row.folder / "predictions.jsonl"
    if not path.exists():
        return {}
    scores = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r["method"] == row.method and str(r["budget"]) == row.budget:
            scores[(r["task"], int(r["index"]))] = float(r["score"])
    return scores


def paired_statistic(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float],
                     samples: set[tuple[str, int]], ratio: bool, draws: int = DRAWS,
                     seed: int = 0) -> tuple[float, float, float]:
    """RULER's average (the mean over tasks of each task's mean score) of ``a`` over that of ``b`` (``ratio``), or
    their difference, on ``samples``; and its 95% percentile interval from a paired bootstrap that resamples each
    task's samples with replacement. A ratio over a zero average is inf."""
    tasks = sorted({t for t, _ in samples})
    rng = np.random.default_rng(seed)
    avg_a = np.zeros(draws)
    avg_b = np.zeros(draws)
    point_a = point_b = 0.0
    for task in tasks:
        keys = sorted(s for s in samples if s[0] == task)
        va = np.array([a[k] for k in keys])
        vb = np.array([b[k] for k in keys])
        pick = rng.integers(0, len(keys), size=(draws, len(keys)))
        avg_a += va[pick].mean(axis=1) / len(tasks)
        avg_b += vb[pick].mean(axis=1) / len(tasks)
        point_a += float(va.mean()) / len(tasks)
        point_b += float(vb.mean()) / len(tasks)
    if ratio:
        stats = np.full(draws, np.inf)
        np.divide(avg_a, avg_b, out=stats, where=avg_b > 0)
        point = point_a / point_b if point_b > 0 else float("inf")
    else:
        stats = avg_a - avg_b
        point = point_a - point_b
    stats.sort()
    return point, float(stats[int(0.025 * draws)]), float(stats[int(0.975 * draws) - 1])


def wins_losses(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float], samples: set[tuple[str, int]],
                ratio: bool, threshold: float) -> tuple[int, int]:
    """Samples where ``a`` beats the reference (``b + threshold``, or ``threshold * b`` for a ratio) and samples
    where it falls short of it; ties are counted in neither."""
    wins = losses = 0
    for s in samples:
        margin = a[s] - threshold * b[s] if ratio else a[s] - b[s] - threshold
        wins += margin > 0
        losses += margin < 0
    return wins, losses


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test of ``wins`` against ``losses`` (ties already dropped): twice the binomial
    (p = 1/2) tail of the smaller count, at most 1; 1 when there is nothing to test."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return min(1.0, 2 * tail / 2**n)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (in the order given): the i-th smallest p of m is multiplied by
    m - i + 1 (i from 1), capped at 1, and made non-decreasing; a test is rejected at level alpha when its adjusted
    p-value is <= alpha."""
    m = len(pvalues)
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def verdict(point: float, low: float, high: float, threshold: float, samples: int, wanted: int, wins: int,
            losses: int, holm_p: float, alpha: float = ALPHA) -> str:
    """``met`` / ``missed`` on the letter; ``settled`` when the interval excludes the threshold on that side and
    the sign test, Holm-adjusted (``holm_p``), rejects no difference at ``alpha`` in the same direction, ``within
    noise`` otherwise; ``running`` below ``wanted``."""
    letter = "met" if point >= threshold else "missed"
    if samples < wanted:
        return f"running ({letter} so far)"
    if letter == "met":
        settled = low > threshold and wins > losses and holm_p <= alpha
    else:
        settled = high < threshold and losses > wins and holm_p <= alpha
    return f"**{letter}**, {'settled' if settled else 'within noise'}"


def _fmt(value: float, ratio: bool) -> str:
    if value == float("inf"):
        return "inf"
    return f"{100 * value:.1f}%" if ratio else f"{100 * value:+.1f}"


def _fmt_p(p: float) -> str:
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def render(root: Path = HERE, cells: list[Cell] = CELLS, targets: list[Target] = TARGETS) -> str:
    """The markdown of ``targets.md`` for the runs under ``root``."""
    rows = []  # (cell, target, samples read, statistics or None, what to say instead)
    sources = []
    for cell in cells:
        scores = {role: load_scores(root, row) for role, row in cell.rows.items()}
        common = set.intersection(*(set(s) for s in scores.values()))
        sources.append(f"- {cell.model} {cell.length}: " + "; ".join(
            f"{role} = {row.label()}" for role, row in cell.rows.items()))
        for target in targets:
            if not common:
                rows.append((cell, target, 0, None, "- | - | - | not run yet"))
                continue
            point, low, high = paired_statistic(scores[target.a], scores[target.b], common, target.ratio)
            if point == float("inf"):  # full attention answers none of these samples: no ratio to read
                said = "undefined" + ("" if len(common) >= cell.samples else " so far (running)")
                rows.append((cell, target, len(common), None, f"- (full attention's average is 0) | - | - | {said}"))
                continue
            wins, losses = wins_losses(scores[target.a], scores[target.b], common, target.ratio, target.threshold)
            rows.append((cell, target, len(common), (point, low, high, wins, losses, sign_test(wins, losses)), ""))
    tested = [r for r in rows if r[3] is not None]
    adjusted = dict(zip((id(r) for r in tested), holm([r[3][5] for r in tested])))
    lines = [
        "# Issue 23's targets, read from the runs",
        "",
        "Generated by `python experiments/ruler/targets.py` from the committed `predictions.jsonl` files (do not edit).",
        "Each cell reads its rows on the samples all of them have finished; an average is RULER's (the mean over tasks",
        "of each task's mean score, x100); a difference is in its points, a ratio is IceCache's average over full's;",
        f"[95% interval] from a paired bootstrap resampled within each task ({DRAWS:,} draws). Wins / losses count the",
        "samples where the left row scores above / below the reference (the right row plus the threshold, or the",
        "threshold times the right row for a ratio: 95% of full's); ties are dropped. Sign p is the two-sided exact sign",
        "test (binomial, p = 1/2) of wins against losses; Holm is that p-value after Holm's step-down correction over",
        f"the {len(tested)} targets tested in this table (family-wise level {ALPHA}).",
        "",
        "Verdict rule: `met` / `missed` is the point estimate against the threshold. `settled` only when both the",
        "bootstrap interval excludes the threshold on that side and the sign test rejects no difference after Holm's",
        f"correction (Holm <= {ALPHA}) in the same direction (more wins than losses for `met`, more losses for",
        "`missed`); `within noise` otherwise. `running` while a cell has fewer samples than the issue asks for.",
        "",
        "| model | length | samples | target | value [95% interval] | wins / losses | sign p (Holm) | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cell, target, n, stats, instead = row
        head = f"| {cell.model} | {cell.length} | {n} of {cell.samples} | {target.name} | "
        if stats is None:
            lines.append(head + instead + " |")
            continue
        point, low, high, wins, losses, p = stats
        holm_p = adjusted[id(row)]
        value = f"{_fmt(point, target.ratio)} [{_fmt(low, target.ratio)}, {_fmt(high, target.ratio)}]"
        said = verdict(point, low, high, target.threshold, n, cell.samples, wins, losses, holm_p)
        lines.append(head + f"{value} | {wins} / {losses} | {_fmt_p(p)} ({_fmt_p(holm_p)}) | {said} |")
    plots = ("Plots (`targets_<model>.png`): RULER's average vs length per row, one panel per task set (lengths that "
             "ran different tasks are never on one line: Gemma-3-270M's 32k ran the 8 NIAH tasks only, so its "
             "11-task panel stops at 16k and a second panel plots every length on the 8 NIAH tasks), and each "
             "method's average relative to full attention's vs budget, one line per length; cells with at least "
             "half of their samples finished.")
    return "\n".join(lines + ["", plots, "", "Rows read:", ""] + sources) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when targets.md is not what the runs give")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(HERE.parents[1])} is stale: run python experiments/ruler/targets.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(text, end="")
    for path in write_plots():
        print(f"wrote {path.relative_to(HERE.parents[1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
