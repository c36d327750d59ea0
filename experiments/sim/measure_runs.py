"""Measure real runs of the runtime for `python -m icecache.sim validate` (and record selection traces).

    .venv/bin/python experiments/sim/measure_runs.py --out icecache/sim/data/measured_runs.jsonl \
        --raw experiments/sim/measured_runs.raw.jsonl --traces-dir experiments/sim/traces --repeats 2   # ~45 min, 2 cores
    .venv/bin/python experiments/sim/measure_runs.py --quick --out /tmp/runs.jsonl   # 8 runs, a few minutes
    .venv/bin/python -m icecache.sim validate --runs /tmp/runs.jsonl --hit experiments/sim/traces/*.jsonl.gz --out /tmp/validation.md

``icecache/sim/data/measured_runs.jsonl`` is the runs file the package ships (``python -m icecache.sim validate``
scores it by default).

One JSON line per run, the format `icecache.sim.validate.MeasuredRun` reads; ``stage_seconds`` are per decode
step (cumulative stats divided by ``steps``). After one warm-up generation per variant (JIT compilation,
allocator), the grid is measured ``--repeats`` times, in rounds, each round in its own shuffled order, so the
machine's slow drift does not line up with the grid; every run goes to ``--raw`` (default ``<out>.raw.jsonl``) as
it finishes (``--resume`` continues from it) and ``<out>`` gets one row per configuration: the medians over its repeats.

``--probe`` times a fixed short workload (full attention, 1,024-token prompt, 16 steps: `icecache.measure.drift`)
just before every run and keeps it in the run's row; ``--rescale-drift`` then writes ``<out>`` from every repeat
rescaled to the session's median probe speed (raw timings kept in each row's ``raw_timings``). A finished run
file can be rescaled again without measuring: ``--resume --rescale-drift`` with the same grid.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VARIANT_CONFIG = {
    # variant: IceCacheConfig keyword arguments (full: no config, the model's own attention)
    "full": None,
    "icecache": {"index": "mdci"},
    "icecache-r": {"index": "mdci", "reuse_every": 4},
    "quest": {"index": "sequential"},
}


def prompt_of(tokenizer: Any, n_tokens: int) -> str:
    """Text of about ``n_tokens`` tokens from Python's own documentation (deterministic, no download)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"][:n_tokens]
    return tokenizer.decode(ids) + "\n\nSummarise the text above in one sentence."


def per_step(stats: dict[str, Any]) -> dict[str, float]:
    steps = max(int(stats.get("steps", 0) or 0), 1)
    return {k: float(v) / steps for k, v in (stats.get("stage_seconds") or {}).items()}


def measure_one(model: Any, tokenizer: Any, variant: str, context: int, budget: int, page_size: int, threads: int,
                new_tokens: int, trace_path: Path | None) -> dict[str, Any]:
    from icecache.core.config import IceCacheConfig
    from icecache.runtime.generate import generate  # lazy: the runtime lands separately

    kw = VARIANT_CONFIG[variant]
    cfg = None if kw is None else IceCacheConfig(budget=budget, page_size=page_size, threads=threads,
                                                  trace=trace_path is not None, **kw)
    res = generate(model, tokenizer, prompt_of(tokenizer, context), config=cfg, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, chat=True,  # the chat template, as the committed runs were measured
                   return_result=True)  # every method decodes the same steps
    stats = dict(getattr(res, "stats", {}) or {})
    trace = stats.pop("trace", None) or getattr(res, "trace", None)
    row = {
        "variant": variant, "model": "smollm2-135m-instruct",
        "context": int(getattr(res, "prompt_tokens", context)), "budget": budget, "page_size": page_size,
        "threads": threads, "new_tokens": int(getattr(res, "new_tokens", new_tokens)),
        "tpot_s": float(res.tpot_seconds), "tt2t_s": float(res.tt2t_seconds), "ttft_s": float(res.ttft_seconds),
        "stage_seconds": per_step(stats), "hardware": "this-machine",
        "reuse_every": (kw or {}).get("reuse_every", 1), "pager": (kw or {}).get("index"),
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    }
    if "page_reuse_rate" in stats:
        row["page_reuse_rate"] = float(stats["page_reuse_rate"])
    if trace and trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"budget": budget, "page_size": page_size, "context": row["context"], "variant": variant,
                "model": row["model"], "threads": threads}
        with trace_path.open("w") as fh:
            fh.write(json.dumps({"meta": meta}) + "\n")
            for rec in trace:
                fh.write(json.dumps(rec) + "\n")
    return row


def rescale_all(runs: dict[tuple[int, int], dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Every run at the session's median probe speed (`icecache.measure.drift`); refuses runs without a probe."""
    from icecache.measure.drift import SpeedProbe, drift_factors, rescaled_run

    keys = sorted(runs)
    missing = [k for k in keys if "probe" not in runs[k]]
    if missing:
        raise SystemExit(f"--rescale-drift: {len(missing)} runs have no probe (measured without --probe)")
    factors = drift_factors([SpeedProbe(**runs[k]["probe"]) for k in keys])
    return {k: rescaled_run(runs[k], *f) for k, f in zip(keys, factors)}


def median_run(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeats -> one row: TPOT, TT2T, TTFT and every per-step stage time are the medians
    over the repeats (each separately); the repeats' values stay listed (``repeats_*``)."""
    row = {k: v for k, v in reps[0].items() if k not in ("round", "grid_index", "loadavg", "probe", "raw_timings", "drift_factors")}
    if "drift_factors" in reps[0]:
        row["repeats_drift_factors"] = [r["drift_factors"] for r in reps]
    if len(reps) == 1:
        return row
    for key in ("tpot_s", "tt2t_s", "ttft_s"):
        row[key] = statistics.median(r[key] for r in reps)
        row[f"repeats_{key}"] = [r[key] for r in reps]
    stages = sorted({s for r in reps for s in r["stage_seconds"]})
    row["stage_seconds"] = {s: statistics.median(r["stage_seconds"].get(s, 0.0) for r in reps) for s in stages}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the runs file (one row per configuration) to write")
    ap.add_argument("--raw", default=None, help="every run as it finishes (default: <out>.raw.jsonl)")
    ap.add_argument("--traces-dir", default=None, help="also record one selection trace per sparse configuration")
    ap.add_argument("--variants", default="full,icecache,icecache-r,quest")
    ap.add_argument("--contexts", default="1024,2048,4096,7000")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--page-sizes", default="8,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="order of the configurations in each round")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in the --raw file and measure only the rest")
    ap.add_argument("--quick", action="store_true", help="contexts 1024,4096; budget 256; page 16; threads 2")
    ap.add_argument("--probe", action="store_true", help="time the speed probe just before every run (about 2 s each)")
    ap.add_argument("--rescale-drift", action="store_true",
                    help="write <out> from the runs rescaled to the session's median probe speed (needs --probe runs)")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.budgets, args.page_sizes, args.threads = "1024,4096", "256", "16", "2"

    import icecache

    model, tokenizer = icecache.load_model()
    ints = lambda s: [int(x) for x in s.split(",") if x]
    grid = []
    for v in args.variants.split(","):
        for c in ints(args.contexts):
            if v == "full":
                grid.append((v, c, ints(args.budgets)[0], ints(args.page_sizes)[0], ints(args.threads)[0]))
            else:
                grid += [(v, c, b, p, t) for b, p, t in itertools.product(ints(args.budgets), ints(args.page_sizes), ints(args.threads))]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw_path = Path(args.raw) if args.raw else out.with_name(out.stem + ".raw.jsonl")
    done: dict[tuple[int, int], dict[str, Any]] = {}  # (round, grid index) -> run
    if args.resume and raw_path.exists():
        for line in raw_path.read_text().splitlines():
            r = json.loads(line)
            v, c, b, p, t = grid[r["grid_index"]]
            if (r["variant"], r["budget"], r["page_size"], r["threads"]) != (v, b, p, t) or not c <= r["context"] < c + 256:
                raise SystemExit(f"--resume: {raw_path} holds a run that is not grid entry {r['grid_index']}; rerun without --resume")
            done[(r["round"], r["grid_index"])] = r
        print(f"resuming: {len(done)} runs already in {raw_path}", flush=True)
    print(f"{len(grid)} configurations x {args.repeats} rounds; warm-up ...", flush=True)
    from icecache.measure.drift import PROBE_CONTEXT, measure_probe

    probe_prompt = prompt_of(tokenizer, PROBE_CONTEXT)
    if len(done) < len(grid) * args.repeats:
        for v in args.variants.split(","):  # every path once (allocators, numba compilation, first-call costs)
            measure_one(model, tokenizer, v, 512, 64, 16, 1, args.new_tokens // 4 or 2, None)
        if args.probe:
            measure_probe(model, tokenizer, probe_prompt)
    t0 = time.perf_counter()
    total = len(grid) * args.repeats
    with raw_path.open("a" if done else "w") as fh:
        for rnd in range(args.repeats):
            # rounds, each in its own shuffled order: the machine's drift over minutes spreads over all
            # configurations instead of following the grid order (variant by variant)
            order = list(range(len(grid)))
            random.Random(args.seed + rnd).shuffle(order)
            for i in order:
                if (rnd, i) in done:
                    continue
                v, c, b, p, t = grid[i]
                probe = measure_probe(model, tokenizer, probe_prompt).to_dict() if args.probe else None
                trace = Path(args.traces_dir) / f"{v}_n{c}_b{b}_p{p}_t{t}.jsonl" if (args.traces_dir and v != "full" and rnd == 0) else None
                row = measure_one(model, tokenizer, v, c, b, p, t, args.new_tokens, trace)
                if trace is not None and trace.is_file():  # commit-sized: traces compress ~8x
                    with trace.open("rb") as src, gzip.open(trace.with_name(trace.name + ".gz"), "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    trace.unlink()
                row.update(round=rnd, grid_index=i, loadavg=list(os.getloadavg()))
                if probe is not None:
                    row["probe"] = probe
                done[(rnd, i)] = row
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                print(f"[{len(done)}/{total}] round {rnd} {v} n={c} B={b} P={p} T={t}: TPOT {row['tpot_s'] * 1e3:.1f} ms, "
                      f"TT2T {row['tt2t_s']:.2f} s ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.rescale_drift:
        done = rescale_all(done)
        spread = sorted(r["drift_factors"][1] for r in done.values())
        print(f"rescaled to the median probe: decode factors {spread[0]:.2f}-{spread[-1]:.2f} "
              f"(10th-90th percentile {spread[len(spread) // 10]:.2f}-{spread[(9 * len(spread)) // 10]:.2f})")
    with out.open("w") as fh:
        for i in range(len(grid)):
            reps = [done[(rnd, i)] for rnd in range(args.repeats)]
            fh.write(json.dumps(median_run(reps)) + "\n")
    print(f"wrote {out}; median TPOT {statistics.median(json.loads(row)['tpot_s'] for row in out.read_text().splitlines()) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
