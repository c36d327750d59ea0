"""Issue 23's accuracy targets, read from the committed RULER runs: one table, regenerated at every snapshot.

    python experiments/ruler/targets.py           # writes targets.md (printed) and targets_<model>.png
    python experiments/ruler/targets.py --check   # exit 1 when targets.md differs from what the runs give

Each (model, length) cell names the rows it reads (folder, method, budget): the adopted settings' rows for
IceCache and Quest, full attention and the other baselines from the main run of the same samples. Every target
is read on the samples all of the cell's rows have finished, with a paired bootstrap 95% interval resampled within
each task (4,000 draws, seed 0). Verdicts: ``met`` / ``missed`` on the letter (the point estimate), ``settled``
when the whole interval lies on that side of the threshold, ``within noise`` when it straddles it, and
``running`` while the cell has fewer samples than the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "targets.md"
DRAWS = 4000


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


def write_plots(root: Path = HERE, cells: list[Cell] = CELLS) -> list[Path]:
    """``targets_<model>.png`` for every model with records: RULER's average vs length per row, and each method's
    average relative to full attention's vs budget (``icecache.eval.ruler.report.plot``). A cell enters once at
    least half of its samples are finished."""
    from icecache.eval.ruler.report import plot, summarize

    paths = []
    for model in dict.fromkeys(cell.model for cell in cells):
        records = []
        for cell in cells:
            if cell.model == model:
                rows = cell_records(root, cell)
                if len(rows) >= len(cell.rows) * cell.samples / 2:  # a cell too early in its run would mislead
                    records += rows
        if records:
            path = root / f"targets_{model.lower()}.png"
            plot(summarize(records), path)
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


def verdict(point: float, low: float, high: float, threshold: float, samples: int, wanted: int) -> str:
    """``met`` / ``missed`` on the letter, with ``settled`` or ``within noise``; ``running`` below ``wanted``."""
    letter = "met" if point >= threshold else "missed"
    if samples < wanted:
        return f"running ({letter} so far)"
    if point >= threshold:
        return f"**met**, {'settled' if low >= threshold else 'within noise'}"
    return f"**missed**, {'settled' if high < threshold else 'within noise'}"


def _fmt(value: float, ratio: bool) -> str:
    if value == float("inf"):
        return "inf"
    return f"{100 * value:.1f}%" if ratio else f"{100 * value:+.1f}"


def render(root: Path = HERE, cells: list[Cell] = CELLS, targets: list[Target] = TARGETS) -> str:
    """The markdown of ``targets.md`` for the runs under ``root``."""
    lines = [
        "# Issue 23's targets, read from the runs",
        "",
        "Generated by `python experiments/ruler/targets.py` from the committed `predictions.jsonl` files (do not edit).",
        "Each cell reads its rows on the samples all of them have finished; an average is RULER's (the mean over tasks",
        "of each task's mean score, x100); a difference is in its points, a ratio is IceCache's average over full's; [95% interval] from a paired",
        f"bootstrap resampled within each task ({DRAWS:,} draws). `met` / `missed` is the point estimate against the",
        "threshold; `settled` when the whole interval is on that side, `within noise` when it straddles it;",
        "`running` while a cell has fewer samples than the issue asks for.",
        "",
        "| model | length | samples | target | value [95% interval] | verdict |",
        "|---|---|---|---|---|---|",
    ]
    sources = []
    for cell in cells:
        scores = {role: load_scores(root, row) for role, row in cell.rows.items()}
        common = set.intersection(*(set(s) for s in scores.values()))
        sources.append(f"- {cell.model} {cell.length}: " + "; ".join(
            f"{role} = {row.label()}" for role, row in cell.rows.items()))
        for target in targets:
            if not common:
                lines.append(f"| {cell.model} | {cell.length} | 0 of {cell.samples} | {target.name} | - | not run yet |")
                continue
            point, low, high = paired_statistic(scores[target.a], scores[target.b], common, target.ratio)
            if point == float("inf"):  # full attention answers none of these samples: no ratio to read
                value, said = "- (full attention's average is 0)", "undefined"
                said += "" if len(common) >= cell.samples else " so far (running)"
            else:
                value = f"{_fmt(point, target.ratio)} [{_fmt(low, target.ratio)}, {_fmt(high, target.ratio)}]"
                said = verdict(point, low, high, target.threshold, len(common), cell.samples)
            lines.append(f"| {cell.model} | {cell.length} | {len(common)} of {cell.samples} | {target.name} | {value} | "
                         f"{said} |")
    plots = ("Plots (`targets_<model>.png`, RULER's average vs length per row and relative to full attention's vs "
             "budget) show the cells with at least half of their samples finished.")
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
