"""Decode step time of IceCache variants vs full attention, measured in interleaved blocks (issue 4's ratio).

A single pass per variant (``bench_runtime.py``) puts minutes between full attention's steps and IceCache's,
and this 2-core machine's speed drifts by +-10% over minutes. Here every variant prefills the same real text
(Python's docs) once into its own cache, then the variants take turns: ``--reps`` rounds, each of
``--steps`` greedy decode steps per variant. Per block we keep the median step; the ratio of a variant to
full attention is taken block by block (each IceCache block against the full-attention block of the same
round), and the report gives the median ratio and its range over the rounds.

    python experiments/tpot_interleaved.py --context 8000 --variants 'mdci@256,mdci[preset=icecache]@256,sequential@256' \
        --out experiments/bench_runtime/interleaved_8k

``--shared-prefill`` prefills the text once densely and builds every IceCache variant from that cache
(`IceCache.from_dense`, identical to prefilling through it): at Gemma-3's 32k one prefill takes ~8 minutes.
``--model`` picks the model (default: the embedded SmolLM2). A variant ending in ``~numba`` (``exact@256~numba``)
runs on the numba kernels instead of the native library (`icecache.kernels.library.numba_kernels`): the native
path's before/after in one interleaved run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from icecache import IceCache, IceCacheConfig
from icecache.core.spec import parse_spec
from icecache.eval.tasks import text_window
from icecache.kernels.library import kernel_status, numba_kernels
from icecache.runtime.attention import use_attention
from icecache.runtime.models import load_model

NUMBA_SUFFIX = "~numba"


def kernels_for(name: str):
    """The kernel context of a variant: the numba kernels for ``...~numba``, else the default (native when built)."""
    return numba_kernels() if name.endswith(NUMBA_SUFFIX) else nullcontext()


def variant_config(spec: str) -> IceCacheConfig:
    """``pager@budget`` or ``pager[key=value;...]@budget`` -> the config (default sink, window, dense layers).
    ``page_size=N`` and ``insert_every=N`` among the parameters set those config fields instead of pager
    parameters."""
    pager, _, budget = spec.removesuffix(NUMBA_SUFFIX).rpartition("@")
    if not pager or not budget.isdigit():
        raise SystemExit(f"bad variant {spec!r}: expected pager@budget or pager[key=value;...]@budget")
    index, params = parse_spec(pager)
    page_size = params.pop("page_size", IceCacheConfig.page_size)
    insert_every = params.pop("insert_every", IceCacheConfig.insert_every)
    return IceCacheConfig(index=index, budget=int(budget), index_params=params, page_size=page_size,
                          insert_every=insert_every)


def decode_block(model, cache, tok: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
    """``steps`` greedy decode steps; returns the last token and each step's seconds."""
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, past_key_values=cache, use_cache=True)
        tok = out.logits[0, -1].argmax().view(1, 1)
        ts.append(time.perf_counter() - t0)
    return tok, ts


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--variants", default="mdci@256,mdci[preset=icecache]@256,sequential@256",
                    help="comma-separated pager@budget or pager[key=value;...]@budget")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per block")
    ap.add_argument("--reps", type=int, default=6, help="rounds of blocks")
    ap.add_argument("--floor", type=int, default=0,
                    help="also time full attention at this context (e.g. 324 = sink + window + budget 256: the step "
                         "IceCache would take if selection and loading were free); ratios vs it are reported too")
    ap.add_argument("--model", default=None, help="a name of icecache.MODELS (default: the embedded SmolLM2)")
    ap.add_argument("--shared-prefill", action="store_true",
                    help="prefill once densely and build every IceCache variant from it (IceCache.from_dense)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import DynamicCache

    t_start = time.perf_counter()
    model, tok = load_model(args.model)
    ids = torch.tensor([text_window(tok, args.context, seed=0)])
    specs = [s.strip() for s in args.variants.split(",") if s.strip()]
    caches: dict[str, object] = {"full": DynamicCache()}
    prompts = {"full": ids}
    floor = f"floor@{args.floor}" if args.floor else None
    if floor:
        caches[floor] = DynamicCache()
        prompts[floor] = torch.tensor([text_window(tok, args.floor, seed=0)])
    dense = lambda name: name == "full" or name == floor
    last: dict[str, torch.Tensor] = {}
    first_token = None
    if args.shared_prefill:
        t0 = time.perf_counter()
        out = model(ids, past_key_values=caches["full"], use_cache=True, logits_to_keep=1)
        first_token = out.logits[0, -1].argmax().view(1, 1)
        print(f"shared dense prefill of {ids.shape[1]} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    for s in specs:
        if args.shared_prefill:
            t0 = time.perf_counter()
            with kernels_for(s):
                caches[s] = IceCache.from_dense(caches["full"], variant_config(s), model_config=model.config)
            print(f"{s}: built from the dense prefill in {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            caches[s] = IceCache(model.config, variant_config(s))
        prompts[s] = ids
    try:
        for name, cache in caches.items():
            if first_token is not None and name != floor:  # prefilled above
                with use_attention(model) if not dense(name) else nullcontext(), kernels_for(name):
                    last[name], _ = decode_block(model, cache, first_token, 4)  # warm-up
                continue
            ctx = use_attention(model) if not dense(name) else nullcontext()
            with ctx, kernels_for(name):
                t0 = time.perf_counter()
                out = model(prompts[name], past_key_values=cache, use_cache=True, logits_to_keep=1)
                t, _ = decode_block(model, cache, out.logits[0, -1].argmax().view(1, 1), 4)  # warm-up
                last[name] = t
            print(f"{name}: prefilled {prompts[name].shape[1]} tokens + 4 warm-up steps in {time.perf_counter() - t0:.1f} s", flush=True)
        blocks: dict[str, list[float]] = {n: [] for n in caches}
        steps_all: dict[str, list[float]] = {n: [] for n in caches}
        stage_ms: dict[str, dict[str, float]] = {}
        for r in range(args.reps):
            for name, cache in caches.items():
                before = dict(cache.timer.seconds) if isinstance(cache, IceCache) else None
                ctx = use_attention(model) if not dense(name) else nullcontext()
                with ctx, kernels_for(name):
                    last[name], ts = decode_block(model, cache, last[name], args.steps)
                blocks[name].append(1e3 * statistics.median(ts))
                steps_all[name].extend(1e3 * x for x in ts)
                if before is not None:
                    acc = stage_ms.setdefault(name, {})
                    for k, v in cache.timer.seconds.items():
                        acc[k] = acc.get(k, 0.0) + 1e3 * (v - before.get(k, 0.0)) / (args.steps * args.reps)
            print(f"round {r + 1}/{args.reps}: " + ", ".join(f"{n} {blocks[n][-1]:.1f}" for n in caches) + " ms", flush=True)
        res: dict = {
            "context": int(ids.shape[1]), "steps_per_block": args.steps, "reps": args.reps,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
            "kernels": kernel_status().as_dict(), "variants": {},
        }
        for name in caches:
            ratios = [b / f for b, f in zip(blocks[name], blocks["full"])]
            res["variants"][name] = {
                "block_median_ms": blocks[name],
                "median_step_ms": statistics.median(steps_all[name]),
                "ratio_vs_full_median": statistics.median(ratios),
                "ratio_vs_full_min": min(ratios),
                "ratio_vs_full_max": max(ratios),
                "stage_ms_per_step": stage_ms.get(name, {}),
            }
            if floor:
                to_floor = [b / f for b, f in zip(blocks[name], blocks[floor])]
                res["variants"][name].update(ratio_vs_floor_median=statistics.median(to_floor),
                                             ratio_vs_floor_min=min(to_floor), ratio_vs_floor_max=max(to_floor))
            if isinstance(caches[name], IceCache):
                st = caches[name].stats()
                res["variants"][name]["device_kv_fraction"] = st["device_kv_bytes"] / st["full_kv_bytes"]
                res["variants"][name]["copies_per_layer_step"] = st["copies_per_layer_step"]
                res["variants"][name]["index"] = st["index"]  # what index="auto" chose
    finally:
        for c in caches.values():
            if isinstance(c, IceCache):
                c.close()
    res["wall_s"] = time.perf_counter() - t_start
    lines = [
        f"Context {res['context']} tokens, {args.reps} rounds x {args.steps} decode steps per variant, interleaved; "
        f"torch {res['torch']}, {res['torch_threads']} threads; native kernels: {res['kernels']['isa'] or res['kernels']['reason']} "
        f"(variants ending in {NUMBA_SUFFIX}: numba kernels). Wall {res['wall_s']:.0f} s.",
        "",
        "| variant | median step ms | ratio vs full (median over rounds) | range |" + (" vs floor | range |" if floor else "")
        + " select | gather | copy | scatter | attend | insert | other |",
        "|---|---|---|---|" + ("---|---|" if floor else "") + "---|---|---|---|---|---|---|",
    ]
    for name, v in res["variants"].items():
        st = v["stage_ms_per_step"]
        cells = " | ".join(f"{st[k]:.1f}" if k in st else "" for k in ("select", "gather", "copy", "scatter", "attend", "insert", "other"))
        to_floor = (f" {v['ratio_vs_floor_median']:.2f} | {v['ratio_vs_floor_min']:.2f}-{v['ratio_vs_floor_max']:.2f} |"
                    if floor else "")
        lines.append(f"| {name} | {v['median_step_ms']:.1f} | {v['ratio_vs_full_median']:.2f} | "
                     f"{v['ratio_vs_full_min']:.2f}-{v['ratio_vs_full_max']:.2f} |{to_floor} {cells} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tpot_interleaved.json").write_text(json.dumps(res, indent=1))
        (out / "tpot_interleaved.md").write_text(
            "# Decode step time, interleaved blocks\n\nCommand: `python experiments/tpot_interleaved.py "
            + " ".join(sys.argv[1:]) + "`\n\n" + table + "\n\nStage columns: ms per decode step (all sparse layers).\n"
        )
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
