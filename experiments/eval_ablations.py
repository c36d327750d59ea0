"""Ablations of IceCache on the embedded model: page size, window, dense layers, GQA mode, layer reuse and the
index parameters, each changed alone from the defaults (mdci, budget 64, page 16, sink 4, window 64,
dense layers 0-1).

Two measurements per configuration, every configuration decoding from the same shared prefills:
* passkey accuracy at ``--passkey-tokens`` (default 8000) over ``--samples`` depths;
* perplexity of real text (Python's docs) teacher-forced for ``--ppl-tokens`` after a ``--ppl-context`` prefix,
  so the window slides and incremental insertion runs.

    python experiments/eval_ablations.py --out experiments/eval/ablations
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import icecache
from icecache import IceCache, IceCacheConfig
from icecache.core.report import write_csv
from icecache.eval.harness import clone_kv, decode_forced, decode_greedy, run_prefill
from icecache.eval.passkey import make_passkey, passkey_correct
from icecache.eval.runner import wilson
from icecache.eval.tasks import make_ppl

BASE = dict(index="mdci", budget=64, page_size=16, sink=4, window=64, dense_layers=(0, 1))
ABLATIONS: list[tuple[str, str, dict]] = [
    ("default", "-", {}),
    ("page size", "8", {"page_size": 8}),
    ("page size", "32", {"page_size": 32}),
    ("window", "16", {"window": 16}),
    ("window", "256", {"window": 256}),
    ("dense layers", "none", {"dense_layers": ()}),
    ("GQA", "per-head", {"gqa": "per-head"}),
    ("reuse", "r=2", {"reuse_every": 2}),
    ("reuse", "r=4", {"reuse_every": 4}),
    ("levels", "p0=0.1", {"index_params": {"p0": 0.1}}),
    ("levels", "p0=0.01", {"index_params": {"p0": 0.01}}),
    ("field of view", "F=10", {"index_params": {"field_of_view": 10}}),
    ("field of view", "F=120", {"index_params": {"field_of_view": 120}}),
    ("page split", "2means", {"index_params": {"page_split": "2means"}}),
    ("search preset", "icecache (published)", {"index_params": {"preset": "icecache"}}),
]
REFERENCES = [("full attention", "-", None), ("exact top-B", "64", {"index": "exact"}), ("quest", "64", {"index": "sequential"})]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--budget", type=int, default=BASE["budget"], help="budget of every configuration (default 64)")
    ap.add_argument("--passkey-tokens", type=int, default=8000)
    ap.add_argument("--ppl-context", type=int, default=4000)
    ap.add_argument("--ppl-tokens", type=int, default=256)
    ap.add_argument("--ppl-samples", type=int, default=2)
    ap.add_argument("--out", default="experiments/eval/ablations")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok = icecache.load_model()
    stop = {tok.eos_token_id}
    base = {**BASE, "budget": args.budget}
    refs = [(g, str(args.budget) if v != "-" else v, ch) for g, v, ch in REFERENCES]
    configs = [(g, v, ch) for g, v, ch in ABLATIONS] + refs
    rows = []
    for i in range(args.samples):
        sample = make_passkey(tok, args.passkey_tokens, depth=0.1 + 0.8 * i / max(args.samples - 1, 1), seed=1000 + i)
        pre = run_prefill(model, tok(sample.prompt, return_tensors="pt")["input_ids"])
        for group, value, change in configs:
            cache = clone_kv(pre.kv) if change is None else IceCache(model.config, IceCacheConfig(**{**base, **change})).load_prefill(pre.kv)
            text = tok.decode(decode_greedy(model, cache, pre.last_logits, 8, stop))
            if isinstance(cache, IceCache):
                cache.close()
            rows.append({"group": group, "value": value, "task": "passkey", "sample": i, "score": float(passkey_correct(sample, text))})
            print(json.dumps(rows[-1]), flush=True)
    for i in range(args.ppl_samples):
        s = make_ppl(tok, args.ppl_context, args.ppl_tokens, seed=2000 + i)
        pre = run_prefill(model, torch.tensor([s.context]))
        for group, value, change in configs:
            cache = clone_kv(pre.kv) if change is None else IceCache(model.config, IceCacheConfig(**{**base, **change})).load_prefill(pre.kv)
            nll = decode_forced(model, cache, pre.last_logits, s.targets)
            if isinstance(cache, IceCache):
                cache.close()
            rows.append({"group": group, "value": value, "task": "ppl", "sample": i, "score": float(nll.mean())})
            print(json.dumps(rows[-1]), flush=True)
    wall = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "ablations.csv", rows)
    table = []
    for group, value, _ in configs:
        pk = [r["score"] for r in rows if r["group"] == group and r["value"] == value and r["task"] == "passkey"]
        nll = [r["score"] for r in rows if r["group"] == group and r["value"] == value and r["task"] == "ppl"]
        lo, hi = wilson(sum(pk), len(pk))
        table.append((group, value, np.mean(pk), lo, hi, len(pk), math.exp(np.mean(nll)), len(nll)))
    full_ppl = next(t[6] for t in table if t[0] == "full attention")
    lines = [
        "# IceCache ablations (embedded SmolLM2-135M)",
        "",
        f"Command: `python experiments/eval_ablations.py {' '.join(sys.argv[1:])}`  ",
        f"Wall time: {wall:.0f} s. Defaults: {base} (mdci preset wide); each row changes one thing. Passkey: {args.samples} samples at "
        f"{args.passkey_tokens} tokens (depths 0.1..0.9); perplexity: {args.ppl_samples} real-text windows, "
        f"{args.ppl_tokens} teacher-forced tokens after {args.ppl_context} tokens of context.",
        "",
        "| ablation | value | passkey accuracy [95% CI] (n) | perplexity (n) | vs full |",
        "|---|---|---|---|---|",
    ]
    for group, value, acc, lo, hi, n, ppl, m in table:
        lines.append(f"| {group} | {value} | {acc:.2f} [{lo:.2f}, {hi:.2f}] ({n}) | {ppl:.3f} ({m}) | {100 * (ppl / full_ppl - 1):+.2f}% |")
    (out / "ablations.md").write_text("\n".join(lines) + "\n\n![ablations](ablations.png)\n")
    _plot(table, out / "ablations.png", full_ppl)
    print("\n".join(lines))
    return 0


def _plot(table, path: Path, full_ppl: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{g}: {v}" for g, v, *_ in table]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(table) + 1.5), sharey=True)
    y = np.arange(len(table))
    axes[0].barh(y, [t[2] for t in table], xerr=[[t[2] - t[3] for t in table], [t[4] - t[2] for t in table]], color="tab:blue")
    axes[0].set_xlabel("passkey accuracy")
    axes[1].barh(y, [100 * (t[6] / full_ppl - 1) for t in table], color="tab:orange")
    axes[1].set_xlabel("perplexity vs full attention (%)")
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
