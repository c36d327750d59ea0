"""Long context on Gemma-3-270M (hybrid: 15 sliding-window layers + 3 global layers): device KV bytes and
decode time per token against context length, full attention vs IceCache, in one run.

For each context, the prompt (real text, Python's docs) is prefilled once and decoded ``--steps`` greedy tokens
by each variant from that shared prefill (TPOT does not depend on how the prefill was run). Reported: median
decode-step time, device KV bytes of the global layers and of the sliding layers, and the ratios to full.

    python experiments/longctx_gemma.py --contexts 2000,4000,8000,16000,32000 --out experiments/longctx
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import icecache
from icecache import IceCache, IceCacheConfig
from icecache.core.spec import parse_spec
from icecache.eval.harness import run_prefill
from icecache.eval.tasks import text_window
from icecache.runtime.attention import (
    ATTENTION_NAME,
    use_attention,
)


def kv_bytes(cache, kinds, text_cfg) -> int:
    """Device KV bytes of the given layer kinds ("global", "sliding") for a plain DynamicCache."""
    total = 0
    for i, layer in enumerate(cache.layers):
        kind = "sliding" if text_cfg.layer_types[i] == "sliding_attention" else "global"
        if kind in kinds and layer.keys is not None:
            total += 2 * layer.keys.numel() * layer.keys.element_size()
    return total


def variant_config(spec: str) -> IceCacheConfig:
    """``pager@budget`` or ``pager[key=value;...]@budget`` (pager parameters, e.g. ``mdci[preset=icecache]@256``)."""
    pager, _, budget = spec.rpartition("@")
    if not pager or not budget.isdigit():
        raise SystemExit(f"bad variant {spec!r}: expected pager@budget or pager[key=value;...]@budget")
    index, params = parse_spec(pager)
    return IceCacheConfig(index=index, budget=int(budget), dense_layers=(), index_params=params)


@torch.inference_mode()
def decode_steps(model, cache, first: int, steps: int) -> list[float]:
    times = []
    tok = torch.tensor([[first]])
    with use_attention(model, ATTENTION_NAME):
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[0, -1:].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2000,4000,8000,16000,32000")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--variants", default="mdci@256,sequential@256,mdci@64",
                    help="comma-separated pager@budget or pager[key=value;...]@budget")
    ap.add_argument("--out", default="experiments/longctx")
    args = ap.parse_args()
    t_start = time.perf_counter()
    model, tok = icecache.load_model("gemma-3-270m")
    text_cfg = model.config.get_text_config()
    rows = []
    for n in [int(x) for x in args.contexts.split(",")]:
        ids = torch.tensor([[tok.bos_token_id] + text_window(tok, n - 1, seed=n)])
        t0 = time.perf_counter()
        pre = run_prefill(model, ids)
        prefill_s = time.perf_counter() - t0
        first = int(pre.last_logits.argmax())
        variants = [("full", None)] + [(v, variant_config(v)) for v in args.variants.split(",")]
        for name, cfg in variants:
            if cfg is None:  # the model's own cache: sliding layers keep their window, global layers everything
                cache = DynamicCache(config=model.config)
                for i, layer in enumerate(pre.kv.layers):
                    cache.update(layer.keys, layer.values, i)
            else:
                cache = IceCache(model.config, cfg).load_prefill(pre.kv)
            times = decode_steps(model, cache, first, args.steps)
            warm = sorted(times[2:])
            row = {"context": n, "variant": name, "prefill_s": prefill_s, "tpot_ms_median": 1000 * warm[len(warm) // 2],
                   "tpot_ms_mean": 1000 * sum(warm) / len(warm)}
            if cfg is None:
                row["global_kv_bytes"] = kv_bytes(cache, {"global"}, text_cfg)
                row["sliding_kv_bytes"] = kv_bytes(cache, {"sliding"}, text_cfg)
            else:
                st = cache.stats()
                row["global_kv_bytes"] = cache.device_kv_bytes(("sparse",))
                row["sliding_kv_bytes"] = cache.device_kv_bytes(("sliding",))
                row["stage_ms"] = {k: round(1000 * v / max(st["steps"], 1), 2) for k, v in st["stage_seconds"].items()}
                cache.close()
            rows.append(row)
            print(json.dumps(row), flush=True)
    for r in rows:
        full = next(x for x in rows if x["context"] == r["context"] and x["variant"] == "full")
        r["tpot_vs_full"] = r["tpot_ms_median"] / full["tpot_ms_median"]
        r["global_kv_fraction"] = r["global_kv_bytes"] / full["global_kv_bytes"]
    wall = time.perf_counter() - t_start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cols = ["context", "variant", "prefill_s", "tpot_ms_median", "tpot_ms_mean", "tpot_vs_full", "global_kv_bytes",
            "global_kv_fraction", "sliding_kv_bytes"]
    with open(out / "gemma_tpot_memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ["# Gemma-3-270M: decode time and device KV bytes vs context", "",
             f"Command: `python experiments/longctx_gemma.py {' '.join(sys.argv[1:])}`  ",
             f"Wall time: {wall:.0f} s; {args.steps} greedy decode steps per variant (median of steps 3..), real-text prompt. "
             "IceCache runs on the 3 global layers (5, 11, 17); the 15 sliding layers keep their 512-token window either way.", "",
             "| context | variant | prefill s | TPOT ms | TPOT / full | global-layer KV MiB | global KV / full | sliding-layer KV MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['variant']} | {r['prefill_s']:.1f} | {r['tpot_ms_median']:.1f} | {r['tpot_vs_full']:.2f} | "
                     f"{r['global_kv_bytes'] / 2**20:.2f} | {100 * r['global_kv_fraction']:.2f}% | {r['sliding_kv_bytes'] / 2**20:.2f} |")
    (out / "gemma_tpot_memory.md").write_text("\n".join(lines) + "\n\n![tpot](gemma_tpot_memory.png)\n")
    _plot(rows, out / "gemma_tpot_memory.png")
    print("\n".join(lines))
    return 0


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        axes[0].plot([r["context"] for r in rs], [r["tpot_ms_median"] for r in rs], marker="o", label=v)
        axes[1].plot([r["context"] for r in rs], [r["global_kv_bytes"] / 2**20 for r in rs], marker="o", label=v)
    for ax, yl in ((axes[0], "decode ms per token (median)"), (axes[1], "device KV of global layers (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(yl)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle("Gemma-3-270M on this CPU: full attention vs IceCache")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
