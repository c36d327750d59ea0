"""A/B of two checkouts on the decode-time insert path alone: `SemanticPager.insert` of one token plus the
`HeadStore.sync` that replays its page edits, per (layer, KV head), as the runtime calls them every step.

    .venv/bin/python experiments/insert_path_ab.py --a <checkout> --b . --pagers mdci,exact --rounds 3 \\
        --out experiments/bench_runtime/insert_path_ab

Each measurement is a fresh process started in a checkout with ``PYTHONPATH`` set to it (this file is read from
the checkout that runs the A/B). A checkout whose `HeadStore` has `insert_token` (the runtime's decode insert,
in which a pager may write the store itself) is timed through it, as one total (its insert column holds the total,
its sync column 0). Six heads of clustered Gaussian keys (64 clusters, d = 64, page 16) are built
with 2,000 keys each, then 1,500 tokens are inserted into each head one at a time, heads interleaved as in a
decode step; the first 100 are warm-up. One torch thread. Sides alternate (a, b) per pager, rounds outermost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEADS, BUILT, INSERTED, WARMUP, DIM, PAGE = 6, 2000, 1500, 100, 64, 16


def child(pager_name: str) -> dict[str, float]:
    import numpy as np
    import torch

    from icecache.indexes.registry import make_pager
    from icecache.runtime.store import HeadStore

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((64, DIM)) * 3

    def keys(n: int) -> torch.Tensor:
        return torch.from_numpy((centers[rng.integers(0, 64, n)] + rng.standard_normal((n, DIM))).astype(np.float32))

    pagers, stores = [], []
    for h in range(HEADS):
        pager = make_pager(pager_name, head_dim=DIM, page_size=PAGE, seed=h, record_moves=True)
        built = keys(BUILT)
        pager.table.record_moves = False
        pager.build(built)
        pager.table.record_moves = True
        store = HeadStore(pager.table, DIM, torch.float32)
        store.load_layout(built, built.clone())
        pagers.append(pager)
        stores.append(store)
    new = keys(HEADS * INSERTED)
    insert_s = sync_s = 0.0
    whole = hasattr(HeadStore, "insert_token")  # the runtime's own call (a pager may write the store itself)
    for i in range(INSERTED):
        for h in range(HEADS):
            key = new[h * INSERTED + i][None]
            t0 = time.perf_counter()
            if whole:
                stores[h].insert_token(pagers[h], key, key, key, len(pagers[h]))
                t1 = time.perf_counter()
            else:
                pagers[h].insert(key, check=False)
                t1 = time.perf_counter()
                stores[h].sync(pagers[h].table.take_moves(), key, key, first_new=len(pagers[h]) - 1)
            t2 = time.perf_counter()
            if i >= WARMUP:
                insert_s += t1 - t0
                sync_s += t2 - t1
    n = HEADS * (INSERTED - WARMUP)
    return {"insert_us": insert_s / n * 1e6, "sync_us": sync_s / n * 1e6, "total_us": (insert_s + sync_s) / n * 1e6}


def run_side(checkout: Path, pager: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", pager], cwd=checkout, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child in {checkout} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit_of(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--a", type=Path)
    ap.add_argument("--b", type=Path, default=Path("."))
    ap.add_argument("--pagers", default="mdci,exact")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    if args.a is None:
        raise SystemExit("--a <checkout> is required")
    t_start = time.perf_counter()
    pagers = [p.strip() for p in args.pagers.split(",") if p.strip()]
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for pager in pagers:
            for side, checkout in (("a", args.a), ("b", args.b)):
                row = run_side(checkout.resolve(), pager)
                runs.setdefault((pager, side), []).append(row)
                print(f"round {r + 1}/{args.rounds} {side} {pager}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    wall = time.perf_counter() - t_start
    lines = ["| pager | side | insert us (median) | sync us (median) | total us (median) | total us per round |",
             "|---|---|---|---|---|---|"]
    for pager in pagers:
        for side in ("a", "b"):
            rows = runs[(pager, side)]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            lines.append(f"| {pager} | {side} | {med['insert_us']:.1f} | {med['sync_us']:.1f} | {med['total_us']:.1f} | "
                         + " / ".join(f"{r['total_us']:.1f}" for r in rows) + " |")
        a = statistics.median(r["total_us"] for r in runs[(pager, "a")])
        b = statistics.median(r["total_us"] for r in runs[(pager, "b")])
        lines.append(f"| {pager} | b / a | | | {b / a:.2f} | |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(
            "# Insert path A/B\n\nCommand: `python experiments/insert_path_ab.py " + " ".join(sys.argv[1:]) + "`\n\n"
            f"a = {args.a} ({commit_of(args.a)}), b = {args.b} ({commit_of(args.b)}); wall {wall:.0f} s; per "
            "(layer, KV head) and token, one thread.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
