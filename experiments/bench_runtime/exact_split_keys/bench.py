"""The exact scorer's layer select: float32 scan (`icecache.indexes.exact.layer_top_tokens`, the runtime's) vs
the split-key two-pass select of `split_kernels.py` (upper 16 bits first, exact refine of the candidates).

    python experiments/bench_runtime/exact_split_keys/bench.py --out experiments/bench_runtime/exact_split_keys

SmolLM2's shape: 3 KV heads per layer, a group of 3 queries, d = 64, budget 256, 2 select threads. Gaussian
keys and queries. Every timed round reads 64 MiB first (cold caches, as in a decode step) and runs the layers
of one step (30 layers; 8 at 32k keys). Both selects must return the same positions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from numba import njit
from split_kernels import _exact_score, _kth_largest, _scan, layer_top, pad_queries, split_into

from icecache.indexes.exact import group_scores, layer_top_tokens, top_of_scores

HEADS, GROUP, DIM, BUDGET, THREADS = 3, 3, 64, 256, 2


@njit(fastmath={"reassoc", "contract"})
def approx_scan(qpad, hi, lo, n, out):  # the first pass alone
    _scan(qpad, hi, lo, 0, n, False, out)


@njit(fastmath={"reassoc", "contract"})
def refine(qpad, hi, lo, cand):  # exact scores of the candidates alone
    bits = np.empty(hi.shape[1], np.uint32)
    out = np.empty(cand.shape[0], np.float32)
    for c in range(cand.shape[0]):
        out[c] = _exact_score(qpad, hi, lo, cand[c], bits)
    return out


def split(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hi, lo = np.empty(keys.shape, np.uint16), np.empty(keys.shape, np.uint16)
    norms = np.empty(keys.shape[0], np.float32)
    split_into(keys, hi, lo, norms, 0)
    return hi, lo, norms


def part_times(q, qpad, keys, parts, n, layers, approx, cand, lower, evict) -> dict[str, float]:
    """ms per step of each part of one head's select, summed over the step's heads: one thread, cold."""
    out = {}
    for label, fn in (("float32 scan", lambda h: group_scores(q[0], keys[h // HEADS][h % HEADS], n, 1)),
                      ("bf16 scan", lambda h: approx_scan(qpad[0], parts[h // HEADS][0][h % HEADS], parts[h // HEADS][1][h % HEADS], n, approx)),
                      ("refine", lambda h: refine(qpad[0], parts[h // HEADS][0][h % HEADS], parts[h // HEADS][1][h % HEADS], cand)),
                      ("top-k", lambda h: top_of_scores(approx, BUDGET)),
                      ("k-th of bounds", lambda h: _kth_largest(lower, min(BUDGET, n - 1)))):
        fn(0)
        evict.sum()
        t0 = time.perf_counter()
        for h in range(layers * HEADS):
            fn(h)
        out[label] = (time.perf_counter() - t0) * 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    evict = np.ones(64 << 17)  # 64 MiB
    rows = []
    for n in (332, 1700, 7700, 32000):
        layers = 30 if n < 20000 else 8
        keys = [tuple(rng.standard_normal((n, DIM)).astype(np.float32) for _ in range(HEADS)) for _ in range(layers)]
        parts = [tuple(zip(*(split(k) for k in layer))) for layer in keys]
        q = rng.standard_normal((HEADS, GROUP, DIM)).astype(np.float32)
        qpad, bounds = pad_queries(q)
        times: dict[str, list[float]] = {"float32": [], "split": []}
        for r in range(args.rounds + 1):
            for name in times:
                evict.sum()
                t0 = time.perf_counter()
                for layer in range(layers):
                    if name == "float32":
                        layer_top_tokens(q, keys[layer], n, BUDGET, THREADS)
                    else:
                        layer_top(qpad, bounds, *parts[layer], n, BUDGET, THREADS)
                if r:  # round 0 compiles
                    times[name].append((time.perf_counter() - t0) * 1e3)
        same = all((layer_top_tokens(q, keys[i], n, BUDGET, THREADS) == layer_top(qpad, bounds, *parts[i], n, BUDGET, THREADS)).all()
                   for i in range(layers))
        # the parts of one head's select, summed over the step's heads, one thread, cold
        hi, lo, norms = parts[0][0][0], parts[0][1][0], parts[0][2][0]
        approx = np.empty(n, np.float32)
        approx_scan(qpad[0], hi, lo, n, approx)
        lower = approx - bounds[0] * norms
        cut = np.sort(lower)[::-1][min(BUDGET, n) - 1]
        cand = np.flatnonzero(approx + bounds[0] * norms >= cut)
        part_ms = part_times(q, qpad, keys, parts, n, layers, approx, cand, lower, evict)
        rows.append((n, layers, statistics.median(times["float32"]), statistics.median(times["split"]), same, len(cand), part_ms))
        print(rows[-1], flush=True)
    wall = time.perf_counter() - t_start
    lines = [
        "| keys per head | layers | float32 select ms | split select ms | split / float32 | same positions | candidates "
        "(head 0) | float32 scan | bf16 scan | refine | top-k | k-th of bounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, layers, f32, spl, same, cands, p in rows:
        lines.append(f"| {n:,} | {layers} | {f32:.2f} | {spl:.2f} | {spl / f32:.2f} | {same} | {cands} | "
                     + " | ".join(f"{p[k]:.2f}" for k in ("float32 scan", "bf16 scan", "refine", "top-k", "k-th of bounds")) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out, "results.md").write_text(
            "# Exact select: float32 scan vs split keys\n\nCommand: `python experiments/bench_runtime/exact_split_keys/"
            f"bench.py {' '.join(sys.argv[1:])}`\n\nWall {wall:.0f} s; medians of {args.rounds} cold rounds per row "
            "(ms per decode step: all layers' selects, 3 KV heads each, 2 threads). Part columns: one thread, cold, "
            "summed over the step's heads.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
