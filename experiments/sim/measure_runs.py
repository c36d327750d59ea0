"""Measure real runs of the runtime for `python -m icecache.sim validate` (and record selection traces).

Not run yet: it needs the runtime (`icecache.runtime.generate.generate` with ``return_result=True`` and
``IceCacheConfig``-driven caches), which is being written. Once it lands:

    .venv/bin/python experiments/sim/measure_runs.py --out experiments/sim/measured_runs.jsonl \
        --traces-dir experiments/sim/traces                       # about 30-60 min on 2 cores
    .venv/bin/python experiments/sim/measure_runs.py --quick      # 8 runs, a few minutes
    .venv/bin/python -m icecache.sim validate --runs experiments/sim/measured_runs.jsonl \
        --hit experiments/sim/traces/*.jsonl --out experiments/sim/validation.md

One JSON line per run, the format `icecache.sim.validate.MeasuredRun` reads; ``stage_seconds`` are per decode
step (cumulative stats divided by ``steps``). Each configuration is measured after one warm-up generation
(JIT compilation, allocator), ``--repeats`` times; the median-TPOT repeat is kept, all repeats are listed.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
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
    res = generate(model, tokenizer, prompt_of(tokenizer, context), config=cfg, max_new_tokens=new_tokens, return_result=True)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments/sim/measured_runs.jsonl")
    ap.add_argument("--traces-dir", default=None, help="also record one selection trace per sparse configuration")
    ap.add_argument("--variants", default="full,icecache,icecache-r,quest")
    ap.add_argument("--contexts", default="1024,2048,4096,7000")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--page-sizes", default="8,16,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --out (written in grid order) and measure only the rest")
    ap.add_argument("--quick", action="store_true", help="contexts 1024,4096; budget 256; page 16; threads 2")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.budgets, args.page_sizes, args.threads = "1024,4096", "256", "16", "2"

    import icecache

    model, tokenizer = icecache.load_model()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    grid = []
    for v in args.variants.split(","):
        for c in ints(args.contexts):
            if v == "full":
                grid.append((v, c, ints(args.budgets)[0], ints(args.page_sizes)[0], ints(args.threads)[0]))
            else:
                grid += [(v, c, b, p, t) for b, p, t in itertools.product(ints(args.budgets), ints(args.page_sizes), ints(args.threads))]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{len(grid)} configurations; warm-up ...", flush=True)
    for v in args.variants.split(","):  # every path once (allocators, numba compilation, first-call costs)
        measure_one(model, tokenizer, v, 512, 64, 16, 1, args.new_tokens // 4 or 2, None)
    done = 0
    if args.resume and out.exists():
        for line, (v, c, b, p, t) in zip(out.read_text().splitlines(), grid):
            r = json.loads(line)
            if (r["variant"], r["budget"], r["page_size"], r["threads"]) != (v, b, p, t) or not c <= r["context"] < c + 256:
                raise SystemExit(f"--resume: {out} line {done + 1} is not grid entry {(v, c, b, p, t)}; rerun without --resume")
            done += 1
        print(f"resuming after {done} runs already in {out}", flush=True)
    t0 = time.perf_counter()
    with out.open("a" if done else "w") as fh:
        for i, (v, c, b, p, t) in enumerate(grid):
            if i < done:
                continue
            trace = Path(args.traces_dir) / f"{v}_n{c}_b{b}_p{p}_t{t}.jsonl" if (args.traces_dir and v != "full") else None
            reps = [measure_one(model, tokenizer, v, c, b, p, t, args.new_tokens, trace if k == 0 else None) for k in range(args.repeats)]
            med = sorted(reps, key=lambda r: r["tpot_s"])[len(reps) // 2]
            if len(reps) > 1:
                med["repeats_tpot_s"] = [r["tpot_s"] for r in reps]
                med["repeats_tt2t_s"] = [r["tt2t_s"] for r in reps]
            if trace is not None and trace.is_file():  # commit-sized: traces compress ~8x
                with trace.open("rb") as src, gzip.open(trace.with_name(trace.name + ".gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                trace.unlink()
            fh.write(json.dumps(med) + "\n")
            fh.flush()
            print(f"[{i + 1}/{len(grid)}] {v} n={c} B={b} P={p} T={t}: TPOT {med['tpot_s'] * 1e3:.1f} ms, "
                  f"TT2T {med['tt2t_s']:.2f} s ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"wrote {out}; median TPOT {statistics.median(json.loads(l)['tpot_s'] for l in out.read_text().splitlines()) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
