"""The native kernels alone, per instruction set: one decode step's key scans and attentions of SmolLM2 at 8k.

A step of SmolLM2-135M at an 8k context (budget 256) scans 28 sparse layers x 3 KV heads x ~7.9k keys of 64 dims
(170 MiB of float32 keys: far beyond the caches, so the scan streams from DRAM) and attends 3 x 3 queries over
324 slots per layer. This times exactly that on random keys, for every instruction set the CPU runs, float32 scan
vs float16 first pass, 1 and 2 threads, and the numba kernels it replaces (median of --reps steps).

    python experiments/bench_runtime/native_kernels/isa_bench.py --out experiments/bench_runtime/native_kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from icecache.indexes.exact import layer_top_tokens
from icecache.kernels.library import native_kernels
from icecache.runtime.cpu_attention import _attend

LAYERS, HEADS, GROUP, DIM, KEYS, BUDGET, SLOTS = 28, 3, 3, 64, 7933, 256, 324


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` calls of ``fn`` after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not built: make setup")
    rng = np.random.default_rng(0)
    keys = [[rng.standard_normal((KEYS, DIM)).astype(np.float32) for _ in range(HEADS)] for _ in range(LAYERS)]
    halves = [[k.astype(np.float16) for k in layer] for layer in keys]
    norms = [[np.linalg.norm(k, axis=1).astype(np.float32) for k in layer] for layer in keys]
    q = rng.standard_normal((HEADS, GROUP, DIM)).astype(np.float32)
    counts = np.full(HEADS, KEYS, np.int64)
    kv = rng.standard_normal((LAYERS, 2, HEADS, SLOTS, DIM)).astype(np.float32)
    valid = np.ones((HEADS, SLOTS), bool)

    def scan(threads: int, half: bool):
        def step():
            for layer in range(LAYERS):
                kernels.layer_top_tokens(q, keys[layer], counts, BUDGET, halves[layer] if half else None,
                                         norms[layer] if half else None, threads=threads)
        return step

    def attend():
        for layer in range(LAYERS):
            kernels.layer_attend(q, kv[layer, 0], kv[layer, 1], valid, 0.125)

    rows = []
    for isa in kernels.available_isas():
        kernels.set_isa(isa)
        for threads in (1, 2):
            for half in (False, True):
                rows.append({"kernel": "scan", "isa": isa, "threads": threads, "keys": "float16 pass" if half else "float32",
                             "ms_per_step": timed(scan(threads, half), args.reps)})
        rows.append({"kernel": "attend", "isa": isa, "threads": 1, "keys": "float32", "ms_per_step": timed(attend, args.reps)})
    for threads in (1, 2):
        rows.append({"kernel": "scan", "isa": "numba", "threads": threads, "keys": "float32", "ms_per_step": timed(
            lambda t=threads: [layer_top_tokens(q, tuple(keys[layer]), KEYS, BUDGET, t) for layer in range(LAYERS)], args.reps)})
    out = np.empty((1, HEADS, GROUP, DIM), np.float32)
    rows.append({"kernel": "attend", "isa": "numba", "threads": 1, "keys": "float32", "ms_per_step": timed(
        lambda: [_attend(q[None], kv[layer, 0][None], kv[layer, 1][None], valid[None], 0.125, out) for layer in range(LAYERS)],
        args.reps)})
    table = ["| kernel | ISA | threads | keys | ms per decode step |", "|---|---|---|---|---|"]
    table += [f"| {r['kernel']} | {r['isa']} | {r['threads']} | {r['keys']} | {r['ms_per_step']:.2f} |" for r in rows]
    print("\n".join(table))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "isa_bench.json").write_text(json.dumps(rows, indent=1) + "\n")
        (Path(args.out) / "isa_bench.md").write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
