"""The exact pager's select against a plain q.K + top-k, in interleaved rounds (issue 24 target: within 2x).

For each key count, one (layer, KV head)'s keys (Gaussian, d = 64) and a GQA group of 3 queries (SmolLM2's
shape). Per round, each variant runs ``--calls`` selects of budget 256 and keeps its median call; the ratio
to the plain scorer is taken round by round, and the report gives its median and range.

- ``plain``: ``torch.topk((q @ K.T).amax(0), 256)`` -- the floor of any exact scorer;
- ``exact``: ``ExactPager.select_arrays`` (what the runtime calls: pages, CSR, positions, scores);
- ``generic``: the same pager through the base class's rank-then-budget-rule path (what every pager runs;
  the exact pager skips its CSR pass since each page is one token).

    python experiments/exact_select.py --keys 8192,32768,131072 --out experiments/bench_runtime/exact_select
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from icecache.core.pager import SemanticPager
from icecache.indexes.exact import ExactPager


def median_call_us(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="8192,32768,131072", help="comma-separated key counts")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--group", type=int, default=3, help="queries per KV head (GQA group)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200, help="selects per variant and round")
    ap.add_argument("--reps", type=int, default=7, help="rounds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the runtime selects on one thread)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    t_start = time.time()
    rows = []
    for n in (int(x) for x in args.keys.split(",")):
        keys = torch.from_numpy(rng.standard_normal((n, args.dim), dtype=np.float32))
        q = torch.from_numpy(rng.standard_normal((args.group, args.dim), dtype=np.float32))
        pager = ExactPager(args.dim)
        pager.build(keys)
        plain_pos = torch.topk((q @ keys.T).amax(0), args.budget).indices.sort().values.numpy()
        assert np.array_equal(np.sort(pager.select_arrays(q, args.budget)[2]), plain_pos)  # same tokens
        variants = {
            "plain": lambda q=q, keys=keys: torch.topk((q @ keys.T).amax(0), args.budget),
            "exact": lambda q=q, pager=pager: pager.select_arrays(q, args.budget, check=False),
            "generic": lambda q=q, pager=pager: SemanticPager._select_arrays(pager, q, args.budget),
        }
        rounds = [{name: median_call_us(fn, args.calls) for name, fn in variants.items()} for _ in range(args.reps)]
        row = {"keys": n}
        for name in variants:
            row[f"{name}_us"] = round(statistics.median(r[name] for r in rounds), 1)
            if name != "plain":
                ratios = [r[name] / r["plain"] for r in rounds]
                row[f"{name}_ratio"] = round(statistics.median(ratios), 2)
                row[f"{name}_ratio_range"] = [round(min(ratios), 2), round(max(ratios), 2)]
        rows.append(row)
        print(json.dumps(row), flush=True)
    record = {"command": " ".join(["python", "experiments/exact_select.py", *sys.argv[1:]]),
              "wall_s": round(time.time() - t_start, 1), "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)",
              "budget": args.budget, "group": args.group, "dim": args.dim, "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "exact_select.json").write_text(json.dumps(record, indent=1) + "\n")
        lines = ["| keys | plain q.K + top-k (us) | exact pager (us) | ratio (range) | generic path (us) | ratio (range) |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['keys']:,} | {r['plain_us']} | {r['exact_us']} | {r['exact_ratio']}x "
                         f"({r['exact_ratio_range'][0]}-{r['exact_ratio_range'][1]}) | {r['generic_us']} | "
                         f"{r['generic_ratio']}x ({r['generic_ratio_range'][0]}-{r['generic_ratio_range'][1]}) |")
        (out / "exact_select.md").write_text(f"`{record['command']}` ({record['date']}, {record['wall_s']} s, "
                                             f"{record['machine']})\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
