"""Dense prefill of a hybrid model with transformers' SDPA vs the ``icecache`` attention function, which runs
sliding-window layers in blocks of the window (`icecache.runtime.attention.dense_attention`).

    .venv/bin/python experiments/prefill_ab.py --model gemma-3-270m --tokens 8192 --rounds 2 \\
        --out experiments/bench_runtime/prefill_blocked_8k

One process; the two implementations alternate, rounds outermost, on one pydoc prompt (`text_window`, seed 0).
Records per run the prefill seconds, and against the first SDPA run the largest difference of the last
position's logits, whether its argmax agrees, and the largest difference of any layer's cached keys.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from transformers import DynamicCache

    from icecache.eval.tasks import text_window
    from icecache.runtime.attention import use_attention
    from icecache.runtime.models import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids = torch.tensor([text_window(tok, args.tokens, seed=0)])
    t_start = time.perf_counter()
    runs, ref = [], None
    for r in range(args.rounds):
        for name in ("sdpa", "icecache"):
            with torch.inference_mode(), use_attention(model, name):
                kv = DynamicCache()
                t0 = time.perf_counter()
                out = model(ids, past_key_values=kv, use_cache=True, logits_to_keep=1)
                seconds = time.perf_counter() - t0
            logits = out.logits[0, -1].float()
            keys = [layer.keys.clone() for layer in kv.layers]
            row = {"round": r, "attention": name, "prefill_s": seconds}
            if ref is None:
                ref = (logits, keys)
            else:
                row.update(max_logit_diff=float((logits - ref[0]).abs().max()),
                           argmax_same=int(logits.argmax()) == int(ref[0].argmax()),
                           max_key_diff=max(float((a - b).abs().max()) for a, b in zip(keys, ref[1])))
            runs.append(row)
            print(json.dumps(row), flush=True)
    wall = time.perf_counter() - t_start
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "runs.json").write_text(json.dumps({"args": vars(args), "wall_s": wall, "torch": torch.__version__,
                                                   "machine": platform.processor() or platform.machine(),
                                                   "prompt_tokens": ids.shape[1], "runs": runs}, indent=1))
    lines = ["# Prefill A/B: SDPA vs blocked sliding-window attention\n",
             f"Command: `python experiments/prefill_ab.py --model {args.model} --tokens {args.tokens} --rounds {args.rounds} "
             f"--threads {args.threads} --out {args.out}`\n",
             f"{args.model}, {ids.shape[1]} prompt tokens, {args.threads} torch threads; wall {wall:.0f} s.\n",
             "| round | attention | prefill s | max logit diff vs first SDPA run | argmax same | max key diff |",
             "|---|---|---|---|---|---|"]
    for row in runs:
        lines.append(f"| {row['round']} | {row['attention']} | {row['prefill_s']:.1f} | {row.get('max_logit_diff', '-')} | "
                     f"{row.get('argmax_same', '-')} | {row.get('max_key_diff', '-')} |")
    (out_dir / "prefill_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
