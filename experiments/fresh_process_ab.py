"""A/B of two checkouts, one `generate` per fresh process, alternating: what a user's first call sees.

    .venv/bin/python experiments/fresh_process_ab.py --a /work/base --b . --out experiments/bench_runtime/fresh_ab_x

``--a`` / ``--b`` are checkouts (e.g. a `git worktree` of an older commit); each run is
``python experiments/fresh_process_ab.py --child ...`` started in that checkout with ``PYTHONPATH`` set to it, so it
imports that checkout's `icecache` (this file and ``experiments/sim/measure_runs.py`` are read from the checkout
that runs the A/B, so both sides measure the same way). Per configuration and repeat the two sides run back to
back (a, then b), configurations in order, repeats outermost. Every run is one line of ``runs.jsonl`` as it
finishes; ``ab.md`` gets the table (mean TPOT and TTFT per side over the repeats). Interleaved in-process benches
(`tpot_interleaved.py`) warm the allocator and every thread first; this one does not, on purpose.
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

HERE = Path(__file__).resolve().parent
PAGER_OF = {"icecache": "mdci", "exact": "exact", "quest": "sequential", "auto": "auto"}


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE / "sim"))
    from measure_runs import VARIANT_CONFIG, measure_one

    from icecache import load_model

    for name, index in PAGER_OF.items():
        VARIANT_CONFIG.setdefault(name, {"index": index})
    model, tokenizer = load_model(args.model)
    row = measure_one(model, tokenizer, args.pager, args.context, args.budget, args.page_size, args.threads,
                      args.new_tokens, None)
    print(json.dumps({"tpot_ms": row["tpot_s"] * 1e3, "ttft_s": row["ttft_s"],
                      "stages_ms": {k: v * 1e3 for k, v in row["stage_seconds"].items()}}))


def run_one(checkout: Path, args: argparse.Namespace, pager: str, context: int, budget: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--pager", pager, "--context", str(context),
           "--budget", str(budget), "--page-size", str(args.page_size), "--threads", str(args.threads),
           "--new-tokens", str(args.new_tokens), "--model", args.model]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: run in {checkout} failed ({pager} {context} {budget}): "
                         f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit_of(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def write_table(out: Path, rows: list[dict], command: str, wall_s: float, labels: dict[str, str]) -> None:
    configs = sorted({(r["pager"], r["context"], r["budget"]) for r in rows}, key=lambda c: (c[1], c[0], c[2]))
    lines = ["# Fresh-process A/B", "", f"Command: `{command}`", "",
             f"a = {labels['a']}, b = {labels['b']}; one `generate` per process, a and b back to back per "
             f"configuration; wall {wall_s:.0f} s.", "",
             "| pager | context | budget | TPOT a (ms) | TPOT b (ms) | b / a | TTFT a (s) | TTFT b (s) | TPOT runs a | TPOT runs b |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pager, context, budget in configs:
        side = {s: [r for r in rows if (r["pager"], r["context"], r["budget"], r["side"]) == (pager, context, budget, s)]
                for s in ("a", "b")}
        if not side["a"] or not side["b"]:
            continue
        tpot = {s: statistics.mean(r["tpot_ms"] for r in side[s]) for s in side}
        ttft = {s: statistics.mean(r["ttft_s"] for r in side[s]) for s in side}
        runs = {s: " / ".join(f"{r['tpot_ms']:.1f}" for r in side[s]) for s in side}
        lines.append(f"| {pager} | {context} | {budget} | {tpot['a']:.1f} | {tpot['b']:.1f} | {tpot['b'] / tpot['a']:.2f} | "
                     f"{ttft['a']:.2f} | {ttft['b']:.2f} | {runs['a']} | {runs['b']} |")
    (out / "ab.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, help="checkout A (the baseline)")
    ap.add_argument("--b", type=Path, help="checkout B (the change)")
    ap.add_argument("--out", type=Path, help="folder for runs.jsonl and ab.md")
    ap.add_argument("--pagers", default="icecache,exact,quest", help=f"of {', '.join(PAGER_OF)}")
    ap.add_argument("--contexts", default="1000,4000,8000")
    ap.add_argument("--budgets", default="64", help="budgets at every context")
    ap.add_argument("--extra-budgets-at", default="8000:256", help="CONTEXT:BUDGET,... measured as well")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--page-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pager", default="icecache", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.a is None or args.b is None or args.out is None:
        ap.error("--a, --b and --out are required")
    for checkout in (args.a, args.b):
        if not (checkout / "icecache" / "__init__.py").is_file():
            ap.error(f"{checkout} is not a checkout of icecache (no icecache/__init__.py)")
    pagers = args.pagers.split(",")
    if unknown := [p for p in pagers if p not in PAGER_OF]:
        ap.error(f"unknown pager(s) {', '.join(unknown)} (one of {', '.join(PAGER_OF)})")
    contexts = [int(c) for c in args.contexts.split(",")]
    extra = [tuple(int(x) for x in item.split(":")) for item in args.extra_budgets_at.split(",") if item]
    configs = [(pager, context, budget) for context in contexts for pager in pagers
               for budget in sorted({int(b) for b in args.budgets.split(",")} | {b for c, b in extra if c == context})]
    args.out.mkdir(parents=True, exist_ok=True)
    runs_path = args.out / "runs.jsonl"
    labels = {"a": f"{args.a} ({commit_of(args.a)})", "b": f"{args.b} ({commit_of(args.b)})"}
    command = "python experiments/fresh_process_ab.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows: list[dict] = []
    t0 = time.perf_counter()
    total = args.reps * len(configs) * 2
    with runs_path.open("w") as fh:
        for rep in range(args.reps):
            for pager, context, budget in configs:
                for side, checkout in (("a", args.a), ("b", args.b)):
                    row = {"side": side, "checkout": labels[side], "rep": rep, "pager": pager, "context": context,
                           "budget": budget, **run_one(checkout, args, pager, context, budget)}
                    rows.append(row)
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
                    done, elapsed = len(rows), time.perf_counter() - t0
                    print(f"[{done}/{total}] {side} {pager} {context} {budget}: TPOT {row['tpot_ms']:.1f} ms "
                          f"(ETA {elapsed / done * (total - done) / 60:.0f} min)", file=sys.stderr, flush=True)
    write_table(args.out, rows, command, time.perf_counter() - t0, labels)
    print(f"wrote {runs_path} and {args.out / 'ab.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
