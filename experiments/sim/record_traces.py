"""Teacher-forced selection traces from the real pagers on the embedded model's keys and queries.

Until the runtime records traces of real decoding (``IceCacheConfig(trace=True)``), this gives the simulator's
hit-rate model measured inputs: the model prefills a long library text once; for each pager, budget, page size
and context c, every traced (layer, KV head) index is built on the middle keys ``[sink, c - window)``; then for
``steps`` positions ``c, c+1, ...`` the group's real post-RoPE queries select pages, and the key leaving the
window is inserted, as in decoding. Only the queries are teacher-forced (they come from the prompt text, not
from generated tokens). A page counts as new when its id was not selected at the previous step.

    .venv/bin/python experiments/sim/record_traces.py            # about 3-5 minutes on 2 cores

Writes ``experiments/sim/hit_traces.csv`` (one summary per trace), ``experiments/sim/hit_model.json`` (the
parametric model fitted to them, used by ``sweep --hit``) and ``experiments/sim/hit_traces.md``; the traces
themselves go to ``--traces-dir`` (not committed: a few MB).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from pathlib import Path

VARIANT_OF = {"mdci": "icecache", "sequential": "quest", "exact": "exact"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pagers", default="mdci,sequential")
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--page-sizes", default="8,16,32")
    ap.add_argument("--contexts", default="2048,8000")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layer-stride", type=int, default=3, help="trace every k-th sparse layer (all KV heads)")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--out-dir", default="experiments/sim")
    ap.add_argument("--traces-dir", default="/tmp/icecache_sim_traces")
    args = ap.parse_args(argv)

    import icecache
    from icecache.indexes import make_pager
    from icecache.measure.capture import capture_qk, prompt_ids
    from icecache.sim.hitrate import ParametricHitModel, Trace, summarize_trace, write_trace

    ints = lambda s: [int(x) for x in s.split(",") if x]
    contexts = ints(args.contexts)
    t0 = time.perf_counter()
    model, tok = icecache.load_model()
    n_cap = max(contexts) + args.steps + 1
    q, k = capture_qk(model, prompt_ids(tok, n_cap))
    L, hkv, _, d = k.shape
    g = q.shape[1] // hkv
    layers = list(range(args.dense_layers, L, args.layer_stride))
    print(f"captured {n_cap} tokens in {time.perf_counter() - t0:.0f} s; tracing layers {layers}", flush=True)
    summaries, rows = [], []
    for pager_name in args.pagers.split(","):
        for c in contexts:
            for P in ints(args.page_sizes):
                for B in ints(args.budgets):
                    t1 = time.perf_counter()
                    records = []
                    for layer in layers:
                        for h in range(hkv):
                            pager = make_pager(pager_name, head_dim=d, page_size=P, seed=0)
                            pager.build(k[layer, h, args.sink : c - args.window])
                            prev: set[int] = set()
                            for t in range(args.steps):
                                if t:
                                    pos_out = c - args.window + t - 1
                                    pager.insert(k[layer, h, pos_out : pos_out + 1])
                                sel = pager.select(q[layer, h * g : (h + 1) * g, c + t], B)
                                pages = [int(x) for x in sel.pages]
                                new = [p for p in pages if p not in prev]
                                slot = 1 if pager_name == "exact" else P
                                records.append(dict(step=t, layer=layer, kv_head=h, pages=pages, tokens=sel.num_tokens,
                                                    new_pages=len(new), bytes=len(new) * slot * 2 * d * 4))
                                prev = set(pages)
                    meta = dict(budget=B, page_size=P, context=c, variant=VARIANT_OF.get(pager_name, pager_name), pager=pager_name,
                                model="smollm2-135m-instruct", steps=args.steps, layers=layers, teacher_forced=True,
                                pager_page_size=1 if pager_name == "exact" else P, sink=args.sink, window=args.window)
                    trace = Trace(meta=meta, records=records)
                    write_trace(Path(args.traces_dir) / f"{pager_name}_n{c}_b{B}_p{P}.jsonl", trace)
                    s = summarize_trace(trace)
                    summaries.append(s)
                    rows.append({"pager": pager_name, **dataclasses.asdict(s), "seconds": round(time.perf_counter() - t1, 2)})
                    print(f"{pager_name} n={c} P={P} B={B}: page hit {s.page_hit_rate:.3f}, fill {s.fill:.3f}, "
                          f"budget use {s.budget_use:.3f} ({rows[-1]['seconds']} s)", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "hit_traces.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    model_fit = ParametricHitModel.fit([s for s in summaries if s.variant in ("icecache", "quest")])
    model_fit.save(out / "hit_model.json")
    cmd = "python experiments/sim/record_traces.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = ["# Teacher-forced selection traces (hit-rate inputs of the simulator)", "",
          f"Command: `{cmd.strip()}`; wall time {time.perf_counter() - t0:.0f} s.", "",
          f"Embedded model, layers {layers} (sparse layers at stride {args.layer_stride}), all {hkv} KV heads, {args.steps} steps, "
          f"sink {args.sink}, window {args.window}. Page hit rate = selected pages already selected at the previous step.", "",
          "| pager | context | page | budget | page hit rate | fill | budget use | MB copied / step (traced layers, fp32) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['pager']} | {r['context']} | {r['page_size']} | {r['budget']} | {r['page_hit_rate']:.3f} | {r['fill']:.3f} | "
                  f"{r['budget_use']:.3f} | {r['mean_bytes_per_step'] / 1e6:.2f} |")
    md += ["", "Fitted model (`hit_model.json`, logit-linear in ln budget, ln page size, ln context):", ""]
    for v, qs in model_fit.coefs.items():
        md.append(f"- {v}: " + "; ".join(f"{q} [{', '.join(f'{c:.3f}' for c in cs)}]" for q, cs in qs.items()))
    (out / "hit_traces.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'hit_traces.csv'}, {out / 'hit_model.json'}, {out / 'hit_traces.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
