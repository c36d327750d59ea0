"""Wall time per RULER sample for all methods from one shared prefill vs one method alone (issue 23 target:
<= 1.6x at 8k), from a run's ``predictions.jsonl``.

Every record carries the sample's one dense prefill (``prefill_seconds``), the sample's generation
(``sample_seconds``) and the method's own time (``seconds``: building its cache from the shared prefill, then
decoding; ``build_seconds`` of it is the cache build, where recorded). Per sample: all methods = generation +
prefill + the sum of every method's seconds, or, where rows record when they finished after the shared prefill
(``done_after_seconds``: methods run side by side with ``--method-workers``), + the last of those; one method =
generation + prefill + that method's seconds (what a run of that method alone pays), taken from ``--alone RUN``
(a run of that method by itself on the same samples, e.g. on every core while the methods' run used one core
each) when given. Where builds are recorded, the table splits the methods' time into their cache builds and
their decodes (which no sharing can save); side by side, these are sums of time spent in parallel.

    python experiments/ruler/shared_prefill.py experiments/ruler/shared_prefill_8k --one icecache
    python experiments/ruler/shared_prefill.py experiments/ruler/shared_prefill_8k_forked --alone experiments/ruler/shared_prefill_8k_alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a RULER run directory (holds predictions.jsonl)")
    ap.add_argument("--one", default="icecache", help="the method run alone in the comparison")
    ap.add_argument("--alone", default=None, help="a run of --one by itself on the same samples (default: its rows in RUN)")
    args = ap.parse_args()
    run = Path(args.run)
    samples = read_samples(run)
    alone = read_samples(Path(args.alone)) if args.alone else samples
    methods = sorted({r["method"] for rs in samples.values() for r in rs})
    rows = []
    for key, rs in sorted(samples.items()):
        if {r["method"] for r in rs} != set(methods):
            continue  # an unfinished sample
        one_rows = [r for r in alone.get(key, []) if r["method"] == args.one]
        if not one_rows:
            continue  # not in the --alone run
        base = rs[0]["prefill_seconds"] + rs[0]["sample_seconds"]
        one = one_rows[0]["prefill_seconds"] + one_rows[0]["sample_seconds"] + one_rows[0]["seconds"]
        side_by_side = all("done_after_seconds" in r for r in rs) and args.alone is not None
        every = base + (max(r["done_after_seconds"] for r in rs) if side_by_side else sum(r["seconds"] for r in rs))
        builds = sum(r["build_seconds"] for r in rs) if all("build_seconds" in r for r in rs) else None
        decodes = None if builds is None else sum(r["seconds"] for r in rs) - builds
        rows.append((key, rs[0]["prompt_tokens"], rs[0]["prefill_seconds"], builds, decodes, one, every, every / one))
    if not rows:
        print("no finished sample", file=sys.stderr)
        return 1
    source = f"`{Path(args.alone).name}`" if args.alone else "the same run"
    lines = [f"Shared prefill, `{run.name}`: {len(methods)} methods ({', '.join(methods)}) vs `{args.one}` alone "
             f"(from {source})",
             "", "| task | sample | prompt tokens | prefill (s) | all builds (s) | all decodes (s) | one method (s) | "
             "all methods (s) | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    for (task, _length, index), tokens, pre, builds, decodes, one, every, ratio in rows:
        lines.append(f"| {task} | {index} | {tokens} | {pre:.1f} | {fmt(builds)} | {fmt(decodes)} | {one:.1f} | "
                     f"{every:.1f} | {ratio:.2f}x |")
    write_summary(run, lines, [r[-1] for r in rows], sum(r[6] for r in rows) / sum(r[5] for r in rows))
    return 0


def write_summary(out_dir: Path, lines: list[str], ratios: list[float], total: float) -> None:
    """``lines`` (a table) plus the median ratio and the total wall ratio, into ``shared_prefill.md``."""
    lines = [*lines, "", f"Median ratio {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}) "
             f"over {len(ratios)} samples; total wall {total:.2f}x."]
    text = "\n".join(lines) + "\n"
    (out_dir / "shared_prefill.md").write_text(text)
    print(text)


def read_samples(run: Path) -> dict[tuple, list[dict]]:
    """A run's records grouped by sample ``(task, length, index)``."""
    samples: dict[tuple, list[dict]] = defaultdict(list)
    for line in (run / "predictions.jsonl").read_text().splitlines():
        r = json.loads(line)
        samples[(r["task"], r["length"], r["index"])].append(r)
    return samples


if __name__ == "__main__":
    sys.exit(main())
