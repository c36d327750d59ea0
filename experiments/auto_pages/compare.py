"""Paired comparison of M-DCI's pages scanned (`smollm2_4k_scan/`) with the committed SmolLM2 4k RULER run
(`../ruler/smollm2_4k/`: full, exact, M-DCI's tree search), sample by sample on the NIAH samples the scan has
answered so far. Scores x100; the difference's 95% interval is a paired bootstrap over samples, resampled within
each task (5,000 draws, seed 0).

    python experiments/auto_pages/compare.py
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    scan = read(HERE / "smollm2_4k_scan" / "predictions.jsonl")
    scores: dict[tuple, dict] = defaultdict(dict)
    for r in read(HERE.parent / "ruler" / "smollm2_4k" / "predictions.jsonl"):
        if r["task"].startswith("niah") and r["method"] in ("full", "exact", "icecache"):
            scores[(r["task"], r["index"])][(r["method"], str(r["budget"]))] = r["score"]
    print("| budget | samples | full | exact | M-DCI (tree) | M-DCI pages scanned | scan vs tree: same / better / worse "
          "| scan - tree [95% interval] |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in ("64", "256"):
        rows = [(r["task"], r["index"], r["score"]) for r in scan if str(r["budget"]) == budget]
        if not rows:
            continue
        got = np.array([s for _, _, s in rows])
        tree = np.array([scores[(t, i)][("icecache", budget)] for t, i, _ in rows])
        exact = np.array([scores[(t, i)][("exact", budget)] for t, i, _ in rows])
        full = np.array([scores[(t, i)][("full", "-")] for t, i, _ in rows])
        diff = got - tree
        by_task: dict[str, list[int]] = defaultdict(list)
        for k, (task, _, _) in enumerate(rows):
            by_task[task].append(k)
        rng = np.random.default_rng(0)
        draws = [diff[np.concatenate([rng.choice(ix, len(ix)) for ix in by_task.values()])].mean() for _ in range(5000)]
        lo, hi = np.percentile(draws, [2.5, 97.5])
        print(f"| {budget} | {len(rows)} | {100 * full.mean():.1f} | {100 * exact.mean():.1f} | {100 * tree.mean():.1f} | "
              f"{100 * got.mean():.1f} | {(got == tree).sum()} / {(got > tree).sum()} / {(got < tree).sum()} | "
              f"{100 * diff.mean():+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] |")


if __name__ == "__main__":
    main()
