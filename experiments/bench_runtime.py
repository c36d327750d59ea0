"""Runtime benchmark: full attention vs IceCache (mdci, and other pagers) vs Quest-style paging, one run.

For each context length, every variant prefills the same real text (Python's docs) through its own cache
(so IceCache's pipelined offload + index build is inside its time to first/second token), then decodes
``--steps`` greedy tokens. Reported per variant: TTFT, TT2T (the paper's time to second token), TPOT
(vLLM: (end-to-end - TTFT) / (tokens - 1)), median decode step, per-stage breakdown, device KV bytes vs
full, copies per layer step, page reuse. Ratios against full attention come from the same run.

    python experiments/bench_runtime.py --contexts 2000,4000,8000 --budgets 64,256 --pagers mdci,sequential \
        --out experiments/bench_runtime
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import icecache
from icecache import IceCache, IceCacheConfig
from icecache.core.spec import parse_spec
from icecache.eval.tasks import text_window
from icecache.runtime.attention import use_attention


@torch.inference_mode()
def run_variant(model, ids: torch.Tensor, cfg: IceCacheConfig | None, steps: int) -> dict:
    from transformers import DynamicCache

    cache = IceCache(model.config, cfg) if cfg is not None else DynamicCache()
    ctx = use_attention(model) if cfg is not None else _null()
    times = []
    with ctx:
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[0, -1].argmax().view(1, 1)
        ttft = time.perf_counter() - t0
        for _ in range(steps - 1):
            t1 = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[0, -1].argmax().view(1, 1)
            times.append(time.perf_counter() - t1)
        e2e = time.perf_counter() - t0
    row = {
        "ttft_s": ttft,
        "tt2t_s": ttft + times[0],
        "tpot_ms": 1000 * (e2e - ttft) / (steps - 1),
        "step_median_ms": 1000 * sorted(times)[len(times) // 2],
        "steady_tpot_ms": 1000 * sum(times[1:]) / max(len(times) - 1, 1),
    }
    if cfg is not None:
        st = cache.stats()
        n = max(st["steps"], 1)
        row.update(
            device_kv_bytes=st["device_kv_bytes"], full_kv_bytes=st["full_kv_bytes"],
            copies_per_layer_step=st["copies_per_layer_step"], page_reuse_rate=st["page_reuse_rate"],
            index_build_s=st["index_build_seconds"], index_wait_s=st["index_wait_seconds"],
            **{f"stage_{k}_ms": 1000 * v / n for k, v in st["stage_seconds"].items()},
        )
        cache.close()
    else:
        kv = sum(2 * l.keys.numel() * l.keys.element_size() for l in cache.layers)
        row.update(device_kv_bytes=kv, full_kv_bytes=kv)
    return row


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sorted({r["variant"] for r in rows}, key=lambda v: (v != "full", v))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for v in variants:
        rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["context"])
        axes[0].plot([r["context"] for r in rs], [r["tpot_ms"] for r in rs], marker="o", label=v)
    axes[0].set_xlabel("context (tokens)")
    axes[0].set_ylabel("TPOT (ms)")
    axes[0].set_title("Decode time per output token")
    axes[0].legend(fontsize=8)
    top = max(r["context"] for r in rows)
    rs = [r for r in rows if r["context"] == top and r["variant"] != "full"]
    stages = ["select", "gather", "copy", "scatter", "attend", "insert", "other"]
    bottom = [0.0] * len(rs)
    for s in stages:
        vals = [r.get(f"stage_{s}_ms", 0.0) for r in rs]
        axes[1].bar([r["variant"] for r in rs], vals, bottom=bottom, label=s)
        bottom = [b + v for b, v in zip(bottom, vals)]
    full = next((r for r in rows if r["context"] == top and r["variant"] == "full"), None)
    if full:
        axes[1].axhline(full["tpot_ms"], color="k", ls="--", lw=1, label="full TPOT")
    axes[1].set_ylabel("ms per decode step")
    axes[1].set_title(f"IceCache stage breakdown at {top} tokens (rest of the step = model)")
    axes[1].tick_params(axis="x", rotation=30)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_runtime.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2000,4000,8000")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--pagers", default="mdci,sequential",
                    help="comma-separated pagers, each name or name[key=value;...], e.g. mdci[preset=icecache]")
    ap.add_argument("--reuse", default="", help="IceCache(r) variants of the first pager, e.g. 2,4")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="experiments/bench_runtime")
    args = ap.parse_args()
    t_start = time.perf_counter()
    model, tok = icecache.load_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    contexts = [int(x) for x in args.contexts.split(",")]
    warm = torch.tensor([text_window(tok, 256, seed=1)])  # warm-up: first calls allocate, JIT-compile, ...
    specs = [(p, *parse_spec(p)) for p in args.pagers.split(",")]  # (label, index, params)
    for _, index, params in specs:
        run_variant(model, warm, IceCacheConfig(index=index, index_params=params, budget=64, threads=args.threads), 4)
    run_variant(model, warm, None, 4)
    for n in contexts:
        ids = torch.tensor([text_window(tok, n, seed=n)])
        budgets = [int(x) for x in args.budgets.split(",")]
        first = specs[0]
        variants = [("full", None)] + [
            (f"{label}@{b}", IceCacheConfig(index=index, index_params=params, budget=b, threads=args.threads))
            for label, index, params in specs for b in budgets
        ] + [
            (f"{first[0]}-r{r}@{b}", IceCacheConfig(index=first[1], index_params=first[2], budget=b, threads=args.threads, reuse_every=int(r)))
            for r in args.reuse.split(",") if r for b in budgets
        ]
        for name, cfg in variants:
            r = run_variant(model, ids, cfg, args.steps)
            r.update(variant=name, context=n)
            rows.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    for r in rows:  # ratios against full attention at the same context, same run
        full = next(x for x in rows if x["context"] == r["context"] and x["variant"] == "full")
        r["tpot_vs_full"] = r["tpot_ms"] / full["tpot_ms"]
        r["tt2t_vs_full"] = r["tt2t_s"] / full["tt2t_s"]
        r["device_kv_fraction"] = r["device_kv_bytes"] / r["full_kv_bytes"]
    wall = time.perf_counter() - t_start
    cols = ["context", "variant", "ttft_s", "tt2t_s", "tpot_ms", "tpot_vs_full", "tt2t_vs_full", "step_median_ms",
            "device_kv_fraction", "copies_per_layer_step", "page_reuse_rate", "index_build_s", "index_wait_s"] + [
            f"stage_{s}_ms" for s in ("select", "gather", "copy", "scatter", "attend", "insert", "other")]
    with open(out / "bench_runtime.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# Runtime benchmark: IceCache vs full attention on the embedded model",
        "",
        f"Command: `python experiments/bench_runtime.py {' '.join(sys.argv[1:])}`  ",
        f"Wall time: {wall:.0f} s. Machine: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}. Greedy decode of {args.steps} tokens "
        "after a real-text prompt (Python docs); every variant prefills through its own cache.",
        "",
        "| context | variant | TTFT s | TT2T s | TPOT ms | TPOT / full | TT2T / full | device KV / full | copies per layer step | page reuse | select | gather | copy | scatter | attend | insert | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        st = " | ".join(f"{r.get(f'stage_{s}_ms', float('nan')):.1f}" for s in ("select", "gather", "copy", "scatter", "attend", "insert", "other"))
        lines.append(
            f"| {r['context']} | {r['variant']} | {r['ttft_s']:.2f} | {r['tt2t_s']:.2f} | {r['tpot_ms']:.1f} | "
            f"{r['tpot_vs_full']:.2f} | {r['tt2t_vs_full']:.2f} | {100 * r['device_kv_fraction']:.1f}% | "
            f"{r.get('copies_per_layer_step', float('nan')):.2f} | {100 * r.get('page_reuse_rate', float('nan')):.0f}% | {st} |"
        )
    lines.append("\nStage columns: ms per decode step (all sparse layers). ![plot](bench_runtime.png)\n")
    (out / "bench_runtime.md").write_text("\n".join(lines))
    plot(rows, out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
