"""Average RULER score (x100) of rows from several run folders, on the samples every one of those rows finished.

    python experiments/ruler/compare_rows.py experiments/ruler/gemma_8k experiments/ruler/gemma_8k_variants \\
        experiments/ruler/gemma_8k_page4=page4: --rows 'full@-,exact@256,icecache@256,quest@256,page4:icecache@256,...'

A folder written ``DIR=PREFIX`` gives its rows that prefix (two runs of the same method with different settings,
e.g. the pages-of-4 run's ``icecache``). A row is ``METHOD@BUDGET`` (``full@-``). Prints one line per row.
``--paired A,B`` (repeatable; both rows among ``--rows``) adds a paired bootstrap of A minus B on the same samples,
resampled within each task (``--draws``, seed 0): the mean difference x100, its 95% interval and how many samples
each row wins.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def paired_bootstrap(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float], samples: set[tuple[str, int]],
                     draws: int, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over ``samples`` and its 95% percentile interval, resampling each task's samples."""
    by_task: dict[str, list[float]] = {}
    for s in sorted(samples):
        by_task.setdefault(s[0], []).append(a[s] - b[s])
    diffs = [d for v in by_task.values() for d in v]
    rng = random.Random(seed)
    means = sorted(sum(d for v in by_task.values() for d in rng.choices(v, k=len(v))) / len(diffs)
                   for _ in range(draws))
    return sum(diffs) / len(diffs), means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--rows", required=True)
    ap.add_argument("--paired", action="append", default=[], metavar="A,B")
    ap.add_argument("--draws", type=int, default=4000)
    args = ap.parse_args()
    scores: dict[tuple[str, str], dict[tuple[str, int], float]] = {}
    for spec in args.dirs:
        path, _, prefix = spec.partition("=")
        for line in (Path(path) / "predictions.jsonl").read_text().splitlines():
            r = json.loads(line)
            row = (prefix + r["method"], str(r["budget"]))
            scores.setdefault(row, {})[(r["task"], int(r["index"]))] = float(r["score"])
    rows = [tuple(x.rsplit("@", 1)) for x in args.rows.split(",") if x]
    missing = [f"{m}@{b}" for m, b in rows if (m, b) not in scores]
    if missing:
        raise SystemExit(f"no records for {', '.join(missing)}")
    common = set.intersection(*(set(scores[row]) for row in rows))
    print(f"{len(common)} samples finished by all {len(rows)} rows")
    for m, b in rows:
        vals = [scores[(m, b)][s] for s in common]
        print(f"{m}@{b}: {100 * sum(vals) / max(len(vals), 1):.1f}")
    for pair in args.paired:
        a, b = (tuple(x.rsplit("@", 1)) for x in pair.split(","))
        if a not in rows or b not in rows:
            raise SystemExit(f"--paired {pair}: both rows must be among --rows")
        if not common:
            raise SystemExit("no sample finished by every row")
        mean, low, high = paired_bootstrap(scores[a], scores[b], common, args.draws)
        wins = sum(scores[a][s] > scores[b][s] for s in common)
        losses = sum(scores[a][s] < scores[b][s] for s in common)
        print(f"{pair.replace(',', ' - ')}: {100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] "
              f"({wins} samples higher, {losses} lower)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
