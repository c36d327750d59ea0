"""RSS across repeated `icecache.generate` calls in one process (issue 24 target: flat after warm-up, within
50 MiB over 200 calls of 3k tokens).

Each call generates ``--new-tokens`` greedy tokens after a ``--tokens`` prompt of real text (Python's docs;
a different window each call) with the default config, and the process RSS (``/proc/self/statm``) is read
after the call returns. Warm-up: the first ``--warmup`` calls (allocator pools, thread arenas, lazy imports).

    python experiments/generate_rss.py --calls 200 --tokens 3000 --out experiments/bench_runtime/generate_rss
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from tqdm.auto import tqdm

    import icecache
    from icecache.eval.tasks import text_window

    t_start = time.time()
    model, tok = icecache.load_model()
    rows = []
    bar = tqdm(range(args.calls), desc="generate calls", unit="call")
    for i in bar:
        prompt = tok.decode(text_window(tok, args.tokens, seed=i))
        t0 = time.perf_counter()
        icecache.generate(model, tok, prompt, max_new_tokens=args.new_tokens)
        rows.append({"call": i + 1, "seconds": round(time.perf_counter() - t0, 2), "rss_mib": round(rss_mib(), 1)})
        bar.set_postfix(rss_mib=rows[-1]["rss_mib"])
    after = [r["rss_mib"] for r in rows[args.warmup:]]
    growth = max(after) - after[0] if after else 0.0
    record = {"command": " ".join(["python", "experiments/generate_rss.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
              "wall_s": round(time.time() - t_start, 1), "calls": args.calls, "tokens": args.tokens,
              "rss_first_mib": rows[0]["rss_mib"], "rss_after_warmup_mib": after[0] if after else None,
              "rss_last_mib": rows[-1]["rss_mib"], "rss_max_growth_after_warmup_mib": round(growth, 1), "rows": rows}
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "generate_rss.json").write_text(json.dumps(record, indent=1) + "\n")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.plot([r["call"] for r in rows], [r["rss_mib"] for r in rows], marker=".")
            ax.set_xlabel("generate call")
            ax.set_ylabel("process RSS (MiB)")
            ax.set_title(f"{args.calls} calls, {args.tokens}-token prompts")
            fig.tight_layout()
            fig.savefig(out / "generate_rss.png", dpi=120)
        except ImportError:
            print("matplotlib not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
